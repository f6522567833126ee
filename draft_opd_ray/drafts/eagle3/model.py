"""EAGLE-3 draft head: model, training-time test (TTT), Draft-OPD replay forward, vocabulary map, vLLM checkpoint.

The contract is vLLM 0.32 ``model_executor/models/llama_eagle3.py`` (class ``Eagle3LlamaForCausalLM``):

* Features. ``aux_layer_ids`` (strictly increasing) name target hidden states by the *input* of target layer i,
  i.e. HF ``hidden_states[i]`` (vLLM captures ``hidden + residual`` before layer i and concatenates in ascending
  layer order). Ids must be < num_layers: HF's last entry is after the final norm, vLLM's is not.
  (B, T, A*Ht) --fc--> (B, T, H), A = len(aux_layer_ids), Ht = H (the head shares the target's embedding).
* Rows. Row t consumes (f_t, x_{t+1}) at rotary position t and predicts x_{t+2}: f_t is the target feature at
  position t, x_{t+1} the token the target emitted there (vLLM rotates the ids, keeps the positions).
* Layer. ``x = cat(input_layernorm(embed(tok)), hidden_norm(h))`` (2H) -> q/k/v; the residual is h itself
  (before hidden_norm); ``h + o_proj(attn)``, then ``+ mlp(post_attention_layernorm(.))``. That pre-norm output
  is what the next unrolled step consumes as its feature (no fc); logits = lm_head(norm(.)) over the draft
  vocabulary of Vd ids, draft id d <-> target id d + d2t[d]; t2d (V,) marks the target ids that have one.
* TTT attention. Step i (0-based) at row t sits at rotary position t+i, consumes x_{t+i+1} and the head's own
  step-(i-1) output of row t, and attends to the step-0 keys of rows t' <= t plus the keys of steps 1..i of
  row t (positions t+1..t+i). That is exactly vLLM's inference (prefix KV entries come from the target-feature
  pass; each draft step appends one entry at the next position) and SpecForge since PR #244 ("remove attention
  mask shift & add pe shift"; rotary position ``position_ids + lck``). The original EAGLE-3 trainer (SafeAILab
  cnets.py, copied by early SpecForge) also hid the step-0 keys of rows t-i+1..t at step i and kept position t:
  it trains on fewer keys than inference sees, so it is not used here.
  Step i row t is scored against the teacher at position t+i+1 (the target's distribution of x_{t+i+2}).

Checkpoint (``save_eagle3``): config.json ``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``,
``draft_vocab_size``, ``target_hidden_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``; safetensors
``fc.weight``, ``midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm, hidden_norm,
post_attention_layernorm}.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64), ``t2d`` (bool);
``embed_tokens.weight`` is optional (absent: vLLM shares the target's). d2t/t2d are omitted when Vd = V: vLLM
then builds no id map and would reject a d2t tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draft_opd_ray.errors import ModelError
from draft_opd_ray.models.draft_folder import (
    decoder_shape_from_json,
    decoder_shape_json,
    read_draft_folder,
    write_draft_folder,
)
from draft_opd_ray.models.layers import RMSNorm, SwiGLU, apply_rope, init_weights
from draft_opd_ray.models.target import (
    TargetInfo,
    check_layer_ids,
    read_target_info,
    read_target_tensors,
    rope_theta_of,
    spread_layer_ids,
    target_config,
)

ARCHITECTURE = "LlamaForCausalLMEagle3"


def chain_attention(
    q: torch.Tensor,
    mem_k: torch.Tensor,
    mem_v: torch.Tensor,
    mem_mask: torch.Tensor,
    diag_k: Sequence[torch.Tensor] = (),
    diag_v: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Attention over shared memory keys plus per-row "diagonal" keys (a row's own earlier unrolled steps).

    q: (B, h, Q, d); mem_k/mem_v: (B, hk, S, d); mem_mask: (B, Q, S) bool, True = visible;
    diag_k[j]/diag_v[j]: (B, hk, Q, d), seen only by the query of the same row. One softmax runs over the
    visible memory keys and the diagonal keys together. GQA: query head h reads kv head h // (h_total / hk).
    Returns (B, h, Q, d).
    """
    rep = q.shape[1] // mem_k.shape[1]
    scale = q.shape[-1] ** -0.5
    s0 = (q @ mem_k.repeat_interleave(rep, 1).transpose(-1, -2)) * scale  # (B, h, Q, S)
    s0 = s0.masked_fill(~mem_mask[:, None], float("-inf"))
    sd = [(q * k.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale for k in diag_k]  # (B, h, Q, 1)
    w = torch.softmax(torch.cat([s0, *sd], dim=-1).float(), dim=-1).to(q.dtype)
    S = mem_k.shape[2]
    out = w[..., :S] @ mem_v.repeat_interleave(rep, 1)
    for j, v in enumerate(diag_v):
        out = out + w[..., S + j : S + j + 1] * v.repeat_interleave(rep, 1)
    return out


# --------------------------------------------------------------------------------------------------
# Vocabulary map
# --------------------------------------------------------------------------------------------------


def build_vocab_map(
    token_counts: torch.Tensor, draft_vocab_size: int, always_include: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft vocabulary = the ``draft_vocab_size`` most frequent target ids (ties: lower id first), plus
    ``always_include`` (e.g. eos ids, which a draft must be able to propose), in ascending target-id order.

    token_counts: (V,) counts. Returns d2t (Vd,) int64 with target_id = draft_id + d2t[draft_id], and
    t2d (V,) bool, True for the target ids in the draft vocabulary.
    """
    V = token_counts.numel()
    if not 1 <= draft_vocab_size <= V:
        raise ModelError(f"draft_vocab_size {draft_vocab_size} must be in [1, {V}] (the target vocabulary)")
    forced = sorted({int(i) for i in always_include})
    if any(not 0 <= i < V for i in forced) or len(forced) > draft_vocab_size:
        raise ModelError(f"always_include {forced} must be <= {draft_vocab_size} ids in [0, {V})")
    score = token_counts.double().clone()
    score[forced] = float("inf")
    order = torch.sort(-score, stable=True).indices  # stable: lower ids first among equal counts
    chosen = order[:draft_vocab_size].sort().values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft ids of target ids (-1 where the target id is not in the draft vocabulary)."""
    rank = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d[target_ids], rank[target_ids], torch.full_like(target_ids, -1))


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    ids = torch.arange(d2t.numel()) + d2t
    ok = ids.numel() == int(t2d.sum()) and bool((ids >= 0).all()) and bool((ids < t2d.numel()).all())
    if not ok or not bool(t2d[ids].all()) or not bool((ids[1:] > ids[:-1]).all()):
        raise ModelError(f"{where}: d2t and t2d do not describe the same ascending draft vocabulary")


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocabulary V
    draft_vocab_size: int  # Vd
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size  # the head shares the target's embedding, so widths are equal


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


KV = tuple[torch.Tensor, torch.Tensor]


class Eagle3Draft(nn.Module):
    """EAGLE-3 head. Parameter names are the checkpoint's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``);
    ``embed_tokens`` is the target's, frozen."""

    d2t: torch.Tensor  # (Vd,) int64 buffer
    t2d: torch.Tensor  # (V,) bool buffer

    def __init__(self, config: Eagle3Config, embed_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        init_weights(self)
        if embed_weight is not None:
            self.embed_tokens.weight.data.copy_(embed_weight)
        self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(c.vocab_size) < c.draft_vocab_size)

    @property
    def hidden_state_indices(self) -> tuple[int, ...]:
        """Indices into HF ``output_hidden_states`` whose concatenation is the feature tensor."""
        return self.config.aux_layer_ids

    @property
    def draft_ids_in_target(self) -> torch.Tensor:
        """(Vd,) target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        check_vocab_map(d2t.cpu(), t2d.cpu(), "set_vocab_map")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Pre-norm head output (..., H) -> draft-vocabulary logits (..., Vd)."""
        return self.lm_head(self.norm(h))

    def to_target_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """(..., Vd) -> (..., V) with -inf at target ids outside the draft vocabulary (as vLLM does)."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.draft_ids_in_target] = draft_logits
        return out

    def _layer(
        self,
        tok: torch.Tensor,
        hidden: torch.Tensor,
        pos: torch.Tensor,
        mem_mask: torch.Tensor,
        mem: KV | None = None,
        diag: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] = ((), ()),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass of the decoder layer for query rows. tok (B, Q) target ids, hidden (B, Q, H), pos (B, Q).

        mem None: the rows' own keys are the memory (step-0 pass, mem_mask (B, Q, Q)); else mem = step-0
        (k0, v0) (B, hk, S, d) under mem_mask (B, Q, S), and each row also sees its earlier unrolled keys
        ``diag`` and its own key. Returns the pre-norm output (B, Q, H) and this pass's k, v (B, hk, Q, d).
        """
        c, L = self.config, self.midlayer
        B, Q = tok.shape
        x = torch.cat([L.input_layernorm(self.embed_tokens(tok)), L.hidden_norm(hidden)], dim=-1)
        q = L.self_attn.q_proj(x).view(B, Q, -1, c.head_dim).transpose(1, 2)
        k = L.self_attn.k_proj(x).view(B, Q, -1, c.head_dim).transpose(1, 2)
        v = L.self_attn.v_proj(x).view(B, Q, -1, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, pos, c.rope_theta), apply_rope(k, pos, c.rope_theta)
        if mem is None:
            a = chain_attention(q, k, v, mem_mask)
        else:
            a = chain_attention(q, mem[0], mem[1], mem_mask, [*diag[0], k], [*diag[1], v])
        h = hidden + L.self_attn.o_proj(a.transpose(1, 2).reshape(B, Q, -1))
        return h + L.mlp(L.post_attention_layernorm(h)), k, v

    def _prefix_pass(
        self, input_ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, KV, torch.Tensor]:
        """Step 0 over all rows: row t = (f_t, x_{t+1}) at position t, causal. Returns h (B, T, H), (k0, v0)
        and the causal visibility (B, T, T) (a row always sees itself, so padded rows stay finite)."""
        B, T = input_ids.shape
        tok = F.pad(input_ids[:, 1:], (0, 1))
        pos = torch.arange(T, device=input_ids.device).expand(B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()
        mask = (causal & valid[:, None, :]) | torch.eye(T, dtype=torch.bool, device=input_ids.device)
        h, k0, v0 = self._layer(tok, self.fc(features), pos, mask)
        return h, (k0, v0), mask

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        ttt_steps: int = 1,
        attention_mask: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """TTT training forward. input_ids (B, T) = x_0..x_{T-1} (right-padded; attention_mask (B, T) marks real
        tokens), features (B, T, A*Ht) = target aux states at positions 0..T-1.

        Returns ``ttt_steps`` logits tensors (B, T, Vd); step i row t predicts x_{t+i+2} (teacher position
        t+i+1); rows with t+i+1 > T-1 are filler (see ``eagle3_ttt_loss``).
        """
        valid = (
            torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        )
        h, mem, mask = self._prefix_pass(input_ids, features, valid)
        out = [self.logits(h)]
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        dk: list[torch.Tensor] = []
        dv: list[torch.Tensor] = []
        for i in range(1, ttt_steps):
            tok = F.pad(input_ids[:, i + 1 :], (0, i + 1))  # row t consumes x_{t+i+1}
            h, k, v = self._layer(tok, h, pos + i, mask, mem, (dk, dv))
            dk.append(k)
            dv.append(v)
            out.append(self.logits(h))
        return out

    def _unroll(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        anchor_pos: torch.Tensor,
        steps: int,
        feed: Callable[[int, torch.Tensor], torch.Tensor],
        valid: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Draft ``steps`` tokens from every anchor n (last committed token; 1 <= n < T) as vLLM does: row n-1 of
        the step-0 pass, then steps j at position n-1+j consuming ``feed(j, previous pre-norm output)`` (B, N)
        target ids and attending to step-0 keys of rows <= n-1 plus the anchor's own chain. Returns steps x
        (B, N, H) pre-norm outputs (``self.logits`` turns one into draft-vocabulary logits)."""
        T = input_ids.shape[1]
        if bool((anchor_pos < 1).any()) or bool((anchor_pos >= T).any()):
            raise ValueError(f"anchor positions must be in [1, {T}) (the head needs the feature before it)")
        h_all, mem, _ = self._prefix_pass(input_ids, features, valid)
        rows = anchor_pos - 1  # (B, N)
        h = torch.gather(h_all, 1, rows[..., None].expand(-1, -1, h_all.shape[-1]))  # (B, N, H)
        keys = torch.arange(T, device=input_ids.device)
        mem_mask = (keys[None, None, :] <= rows[..., None]) & valid[:, None, :]  # (B, N, T)
        out = [h]
        dk: list[torch.Tensor] = []
        dv: list[torch.Tensor] = []
        for j in range(1, steps):
            h, k, v = self._layer(feed(j, out[-1]), h, rows + j, mem_mask, mem, (dk, dv))
            dk.append(k)
            dv.append(v)
            out.append(h)
        return out

    def block_hidden(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        anchor_pos: torch.Tensor,
        drafted: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Student side of Draft-OPD replay, all anchors of a batch of sequences at once: the normed hidden
        states (B, N, K, H) that feed ``lm_head`` (losses apply the head chunk by chunk over the vocabulary).

        input_ids (B, T) committed sequences; features (B, T, A*Ht) their target aux states; anchor_pos (B, N)
        anchor positions n; drafted (B, N, K) drafted target ids y_1..y_K; [..., k-1, :] conditions on x_{<=n}
        and y_{<k}."""
        valid = (
            torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        )
        steps = self._unroll(
            input_ids, features, anchor_pos, drafted.shape[-1], lambda j, _: drafted[..., j - 1], valid
        )
        return self.norm(torch.stack(steps, dim=2))

    def block_logits(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``lm_head`` over :meth:`block_hidden` (same arguments): (B, N, K, Vd) draft logits, [..., k-1, :] is
        q_k, the draft's distribution of y_k given x_{<=n} and y_{<k} (teacher forcing)."""
        return self.lm_head(self.block_hidden(*args, **kwargs))  # type: ignore[no-any-return]

    @torch.no_grad()
    def propose(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        lengths: torch.Tensor,
        num_speculative_tokens: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft K = ``num_speculative_tokens`` tokens after each verified prefix x_0..x_n
        (n = lengths - 1 >= 1), as vLLM's EAGLE-3 proposer.

        input_ids (B, T) right-padded prefixes; features (B, T, A*Ht) target aux states (only rows < n are read).
        Returns drafted target ids (B, K) and the draft's probabilities q (B, K, V) over the target
        vocabulary (one-hot under greedy).
        """
        valid = torch.arange(input_ids.shape[1], device=input_ids.device)[None] < lengths[:, None]
        ids: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []

        def sample(_: int, h: torch.Tensor) -> torch.Tensor:
            full = self.to_target_vocab(self.logits(h)[:, 0].float())  # (B, V)
            if temperature == 0:
                tok = full.argmax(-1)
                q = F.one_hot(tok, full.shape[-1]).to(full.dtype)
            else:
                q = torch.softmax(full / temperature, dim=-1)
                tok = torch.multinomial(q, 1, generator=generator).squeeze(-1)
            ids.append(tok)
            qs.append(q)
            return tok[:, None]

        last = self._unroll(
            input_ids, features, (lengths - 1)[:, None], num_speculative_tokens, sample, valid
        )[-1]
        sample(num_speculative_tokens, last)
        return torch.stack(ids, dim=1), torch.stack(qs, dim=1)


def eagle3_ttt_loss(
    model: Eagle3Draft,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    ttt_steps: int = 7,
    decay: float = 0.8,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SFT loss: sum_i decay^i * mean soft cross-entropy of step i against the target distribution.

    teacher_logits (B, T, V): target logits at each position p (distribution of x_{p+1}); restricted to the
    draft vocabulary and renormalised. loss_mask (B, T) marks the teacher positions to train (e.g. response).
    Step i row t is scored against teacher position t+i+1. Metrics: ``loss_<i>`` and ``acc_<i>`` (draft
    argmax == target argmax over the full vocabulary).
    """
    steps = model(input_ids, features, ttt_steps=ttt_steps, attention_mask=attention_mask)
    ids = model.draft_ids_in_target
    T = input_ids.shape[1]
    total = features.new_zeros(())
    metrics: dict[str, float] = {}
    for i, logits in enumerate(steps):
        n = T - i - 1
        if n <= 0:
            break
        teacher = teacher_logits[:, i + 1 :].float()
        p = torch.softmax(teacher[..., ids], dim=-1)  # (B, n, Vd)
        logq = torch.log_softmax(logits[:, :n].float(), dim=-1)
        m = loss_mask[:, i + 1 :].float()
        count = m.sum().clamp_min(1.0)
        loss_i = (-(p * logq).sum(-1) * m).sum() / count
        total = total + decay**i * loss_i
        with torch.no_grad():
            hit = (ids[logq.argmax(-1)] == teacher.argmax(-1)).float()
            metrics[f"loss_{i}"] = float(loss_i)
            metrics[f"acc_{i}"] = float((hit * m).sum() / count)
    return total, metrics


# --------------------------------------------------------------------------------------------------
# Building from a target, checking, saving and loading
# --------------------------------------------------------------------------------------------------


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """(2, L/2, L-1): low, middle and the input of the last layer; evenly spread ids for targets too shallow
    for it. vLLM and SpecForge default to L-3 for the high feature; L-1 here because the last layers carry most
    of a small model's next-token prediction (docs/design.md, "Why the defaults")."""
    ids = (2, num_layers // 2, num_layers - 1)
    if ids[0] < ids[1] < ids[2]:
        return ids
    return spread_layer_ids(min(1, num_layers - 1), num_layers - 1, 3)


def check_eagle3_against_target(c: Eagle3Config, t: TargetInfo) -> None:
    """Raise ModelError when the head cannot run on this target."""
    if c.hidden_size != t.hidden_size:
        raise ModelError(
            f"EAGLE-3 head hidden_size {c.hidden_size} != target hidden_size {t.hidden_size} "
            "(the head reads the target's embedding and features)"
        )
    if c.vocab_size != t.vocab_size:
        raise ModelError(f"EAGLE-3 head vocab_size {c.vocab_size} != target vocab_size {t.vocab_size}")
    if not 1 <= c.draft_vocab_size <= t.vocab_size:
        raise ModelError(f"EAGLE-3 draft_vocab_size {c.draft_vocab_size} not in [1, {t.vocab_size}]")
    check_layer_ids(
        c.aux_layer_ids,
        t.num_layers,
        "EAGLE-3 eagle_aux_hidden_state_layer_ids",
        f"target has {t.num_layers} layers; id i is the input of layer i",
    )


def init_eagle3(
    target_path: str | os.PathLike[str],
    *,
    aux_layer_ids: Sequence[int] | None = None,
    draft_vocab_size: int | None = None,
    token_counts: torch.Tensor | None = None,
    intermediate_size: int | None = None,
    lm_head_from_target: bool = False,
    seed: int = 0,
) -> Eagle3Draft:
    """A fresh head for ``target_path``: target attention shape, frozen target embedding, random layer.

    ``draft_vocab_size`` < V needs ``token_counts`` (V,) (draft vocabulary = most frequent ids plus the eos
    ids). ``lm_head_from_target`` copies the target's LM-head rows of the draft vocabulary; the default is a
    small random head (initial loss ~ log Vd; copying target norms into a random head starts far worse).
    """
    info = read_target_info(target_path)
    if draft_vocab_size is not None and draft_vocab_size < info.vocab_size and token_counts is None:
        raise ModelError("a draft vocabulary smaller than the target's needs token_counts to pick it")
    cfg_t = target_config(target_path)
    heads = info.num_attention_heads or 1
    c = Eagle3Config(
        hidden_size=info.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=info.num_key_value_heads or heads,
        head_dim=info.head_dim or info.hidden_size // heads,
        intermediate_size=intermediate_size or info.intermediate_size or 4 * info.hidden_size,
        vocab_size=info.vocab_size,
        draft_vocab_size=draft_vocab_size or info.vocab_size,
        aux_layer_ids=tuple(aux_layer_ids)
        if aux_layer_ids is not None
        else default_aux_layer_ids(info.num_layers),
        rms_norm_eps=float(cfg_t.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta_of(cfg_t, f"target '{target_path}'"),
        max_position_embeddings=info.max_position_embeddings or 4096,
    )
    check_eagle3_against_target(c, info)
    names = ["model.embed_tokens.weight"] + (["lm_head.weight"] if lm_head_from_target else [])
    weights = read_target_tensors(target_path, names)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Eagle3Draft(c, weights["model.embed_tokens.weight"])
    if c.draft_vocab_size < c.vocab_size and token_counts is not None:
        model.set_vocab_map(*build_vocab_map(token_counts, c.draft_vocab_size, info.eos_token_ids))
    if lm_head_from_target:
        model.lm_head.weight.data.copy_(weights["lm_head.weight"][model.draft_ids_in_target])
    return model


def eagle3_hf_config(c: Eagle3Config, t: TargetInfo) -> dict[str, Any]:
    """config.json that vLLM (``LlamaForCausalLMEagle3``), SGLang and speculators load."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **decoder_shape_json(c, t),
        "num_hidden_layers": 1,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "mlp_bias": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        "draft_opd": {"kind": "eagle3", "target_num_layers": t.num_layers},
    }


def save_eagle3(
    model: Eagle3Draft,
    out_dir: str | os.PathLike[str],
    target_path: str | os.PathLike[str],
    *,
    include_embeddings: bool = False,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (float32) as vLLM's eagle3 loader expects."""
    info = read_target_info(target_path)
    check_eagle3_against_target(model.config, info)
    skip = set() if include_embeddings else {"embed_tokens.weight"}
    if model.config.draft_vocab_size == model.config.vocab_size:
        skip |= {"d2t", "t2d"}
    tensors = {k: v for k, v in model.state_dict().items() if k not in skip}
    return write_draft_folder(out_dir, tensors, eagle3_hf_config(model.config, info))


def _config_from_json(cfg: dict[str, Any], where: str) -> Eagle3Config:
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise ModelError(f"{where}: architectures {cfg.get('architectures')} lack '{ARCHITECTURE}'")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ModelError(f"{where}: num_hidden_layers must be 1 for an EAGLE-3 head")
    eagle = cfg.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
    if not aux:
        raise ModelError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids is missing")
    try:
        c = Eagle3Config(
            **decoder_shape_from_json(cfg, where, eps=1e-5),
            draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
            aux_layer_ids=tuple(int(i) for i in aux),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{where}: incomplete EAGLE-3 config.json ({exc!r})") from exc
    if c.target_hidden_size != int(cfg.get("target_hidden_size", c.hidden_size)):
        raise ModelError(f"{where}: target_hidden_size must equal hidden_size {c.hidden_size}")
    return c


def load_eagle3(
    path: str | os.PathLike[str], target_path: str | os.PathLike[str] | None = None
) -> Eagle3Draft:
    """Load a head written by :func:`save_eagle3` (or any vLLM-format EAGLE-3 head with the same layout).

    ``target_path`` is checked against the head and supplies the embedding when the checkpoint has none.
    """
    folder = Path(path)
    where = f"EAGLE-3 draft '{folder}'"
    cfg, tensors = read_draft_folder(folder, where)
    c = _config_from_json(cfg, where)
    if target_path is not None:
        check_eagle3_against_target(c, read_target_info(target_path))
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is None:
        if target_path is None:
            raise ModelError(f"{where} has no embed_tokens.weight: pass target_path to take the target's")
        embed = read_target_tensors(target_path, ["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    model = Eagle3Draft(c, embed.float())
    tensors.setdefault("d2t", model.d2t.clone())
    tensors.setdefault("t2d", model.t2d.clone())
    check_vocab_map(tensors["d2t"], tensors["t2d"], where)
    tensors["embed_tokens.weight"] = model.embed_tokens.weight.data
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:  # shape mismatch
        raise ModelError(f"{where}: weights do not match the config ({exc})") from exc
    if missing or unexpected:
        raise ModelError(
            f"{where}: weights do not match the config (missing {missing}, unexpected {unexpected})"
        )
    return model


def fresh_eagle3(target_path: str | os.PathLike[str], draft: Any, seed: int) -> Eagle3Draft:
    """A new head for ``draft`` (a DraftConfig: its aux layers), the start of a run with neither SFT nor
    draft.path."""
    return init_eagle3(target_path, aux_layer_ids=draft.aux_layer_ids, seed=seed)


# the kind's interface (`drafts/kind.py`, `Pieces.of`)
load, save, fresh = load_eagle3, save_eagle3, fresh_eagle3
