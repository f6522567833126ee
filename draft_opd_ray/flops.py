"""FLOPs accounting so that training methods can be compared at matched compute.

Counts are matrix-multiply FLOPs as executed (2 per multiply-add; padding and masked attention entries
included, because the kernels compute them), which is what ``torch.utils.flop_counter.FlopCounterMode`` counts
(tests/unit/test_flops.py checks the formulas against it). Elementwise work (norms, softmax, rotary) is ignored.

* A linear layer with P weights over T tokens: forward 2PT; backward 2PT for the input gradient (skipped when
  its input needs no gradient) + 2PT for the weight gradient (skipped when frozen). So a trained layer in the
  middle of the network costs the familiar 6PT, a frozen LM head 4PT, the EAGLE-3 ``fc`` (its input, the target
  features, needs no gradient) 4PT.
* Attention over S keys: 4·heads·head_dim·S per query forward (QKᵀ and AV), twice that backward.
* A target forward: 2·(non-embedding parameters + LM head)·T plus its attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from draft_opd_ray.models.target import TargetInfo


class Eagle3Shape(Protocol):
    """The fields of an EAGLE-3 draft's config (``Eagle3Config``) that the EAGLE-3 counts read. Named here so
    that this module, which the drafts import, imports nothing from them."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def draft_vocab_size(self) -> int: ...
    @property
    def aux_layer_ids(self) -> Sequence[int]: ...
    @property
    def target_hidden_size(self) -> int: ...


@dataclass(frozen=True)
class Flops:
    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def eagle3_train_flops(
    c: Eagle3Shape, batch: int, seq_len: int, ttt_steps: int, *, lm_head_trainable: bool = False
) -> Flops:
    """One TTT forward + backward of :class:`~draft_opd_ray.drafts.eagle3.model.Eagle3Draft` on a (batch, seq_len)
    batch. Each of the ``ttt_steps`` passes runs the decoder layer and the LM head over every row; step 0 also
    runs ``fc``; every pass's queries attend to all seq_len step-0 keys (plus diagonal keys, elementwise)."""
    rows = batch * seq_len
    H, A = c.hidden_size, len(c.aux_layer_ids)
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer_p = 2 * H * (q_out + 2 * kv_out) + q_out * H + 3 * H * c.intermediate_size
    head_p = H * c.draft_vocab_size
    fc_p = A * c.target_hidden_size * H
    attn = 4 * c.num_attention_heads * c.head_dim * seq_len  # per query row, forward
    fwd_step = 2 * (layer_p + head_p) + attn
    fwd = rows * (ttt_steps * fwd_step + 2 * fc_p)
    head_bwd = (4 if lm_head_trainable else 2) * head_p
    bwd_step = 4 * layer_p + head_bwd + 2 * attn
    bwd = rows * (ttt_steps * bwd_step + 2 * fc_p)
    return Flops(float(fwd), float(bwd))


def eagle3_block_flops(c: Eagle3Shape, seq_len: int, anchors: int, num_speculative_tokens: int) -> Flops:
    """Student side of Draft-OPD for one sequence (:meth:`Eagle3Draft.block_hidden` + the frozen LM head at the
    block positions), forward + backward: step 0 runs ``fc`` and the layer over all seq_len rows, steps 2..K
    (K = ``num_speculative_tokens``) the layer over the anchor rows only; the head runs on anchors * K rows;
    every query sees seq_len keys."""
    H, A = c.hidden_size, len(c.aux_layer_ids)
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer_p = 2 * H * (q_out + 2 * kv_out) + q_out * H + 3 * H * c.intermediate_size
    head_p = H * c.draft_vocab_size
    fc_p = A * c.target_hidden_size * H
    attn = 4 * c.num_attention_heads * c.head_dim * seq_len
    layer_rows = seq_len + anchors * (num_speculative_tokens - 1)
    fwd = (
        seq_len * 2 * fc_p + layer_rows * (2 * layer_p + attn) + anchors * num_speculative_tokens * 2 * head_p
    )
    bwd = (
        seq_len * 2 * fc_p
        + layer_rows * (4 * layer_p + 2 * attn)
        + anchors * num_speculative_tokens * 2 * head_p
    )
    return Flops(float(fwd), float(bwd))


def target_forward_flops(t: TargetInfo, batch: int, seq_len: int, *, lm_head: bool = True) -> float:
    """One forward of a Llama-style target over a (batch, seq_len) batch (full, unmasked attention matmuls)."""
    H = t.hidden_size
    heads = t.num_attention_heads or 1
    d = t.head_dim or H // heads
    kv = t.num_key_value_heads or heads
    inter = t.intermediate_size or 4 * H
    layer_p = H * (heads * d + 2 * kv * d) + heads * d * H + 3 * H * inter
    rows = batch * seq_len
    per_row = t.num_layers * (2 * layer_p + 4 * heads * d * seq_len) + (
        2 * H * t.vocab_size if lm_head else 0
    )
    return float(rows * per_row)


def feature_pass_flops(t: TargetInfo, batch: int, seq_len: int, head_rows: int) -> float:
    """SFT's target forward over a (batch, seq_len) batch as `draft_opd_ray.sft.features` runs it: the decoder over
    every row, the LM head only on the ``head_rows`` rows whose soft labels the loss reads."""
    return target_forward_flops(t, batch, seq_len, lm_head=False) + float(
        2 * t.hidden_size * t.vocab_size * head_rows
    )


def dflash_forward_flops(c: Any, seq_len: int, anchors: int, predicted: int) -> float:
    """One forward of a DFlash drafter (``DFlashConfig``) over a sequence with ``anchors`` blocks: the context
    projection over every row, each layer's block queries against context + block keys, the LM head on
    ``predicted`` offsets of every block."""
    H, heads, d, kv = c.hidden_size, c.num_attention_heads, c.head_dim, c.num_key_value_heads
    layer_p = H * (heads * d + 2 * kv * d) + heads * d * H + 3 * H * c.intermediate_size
    q_rows = anchors * c.block_size
    fwd = c.num_layers * (
        2 * layer_p * q_rows + 4 * kv * d * H * seq_len + 4 * heads * d * q_rows * (seq_len + c.block_size)
    )
    fwd += 2 * len(c.target_layer_ids) * H * H * seq_len + 2 * H * c.vocab_size * anchors * predicted
    return float(fwd)


def model_config_info(model: Any) -> Any:
    """The fields of a TargetInfo that `target_forward_flops` reads, from a transformers model's config."""
    c = model.config
    heads = c.num_attention_heads
    return SimpleNamespace(
        hidden_size=c.hidden_size,
        num_attention_heads=heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", heads),
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        vocab_size=c.vocab_size,
    )
