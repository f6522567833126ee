"""What differs between the SFT recipes of the three draft kinds; `trainer.run_sft` runs any of them.

A recipe is the draft to train plus the four things the shared loop needs from it:

    kind        features (HF hidden_states)   soft labels over      loss
    eagle3      aux layer inputs               the draft vocabulary  TTT: sum_i 0.8^i soft CE of unrolled step i
    standalone  none                           the whole vocabulary  distillation: soft CE of every response
                                                                     position against the target's top-k
    dflash      target layer outputs           (unused)              random-anchor block CE, exp(-(k-1)/gamma)

The cached features and top-k labels come from one target forward per trajectory (`sft/features.py`); the
recipe names which hidden states and which vocabulary. `save` writes the folder vLLM serves.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from draft_opd_ray.config.schema import DraftConfig

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class Recipe:
    kind: str
    model: nn.Module
    feature_ids: tuple[int, ...]  # HF hidden_states indices concatenated into the cached features
    label_ids: torch.Tensor  # (Vd,) target ids the soft labels are over
    loss: LossFn
    flops: Callable[[dict[str, torch.Tensor]], float]  # training FLOPs of one step on this collated batch
    save: Callable[[nn.Module, Path, str | os.PathLike[str]], Path]


def standalone_layer_ids(num_layers: int, target_layers: int) -> tuple[int, ...]:
    """The target layers a standalone draft starts from: the first ceil(n/2) and the last floor(n/2), i.e. the
    middle of the stack is dropped (layer skipping). On SmolLM2-135M the ends carry the prediction: before any
    training, top-1 agreement with the target on its own answers is 0.25 for layers 0-9 + 20-29, 0.005 for
    the first 19 + the last, 0.09 for 0-7 + 22-29 (docs/LOG.md)."""
    if not 1 <= num_layers < target_layers:
        raise ValueError(f"a standalone draft needs 1..{target_layers - 1} layers, got {num_layers}")
    head = (num_layers + 1) // 2
    return (*range(head), *range(target_layers - (num_layers - head), target_layers))


def standalone_kd_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], chunk_rows: int = 512
) -> tuple[torch.Tensor, dict[str, float]]:
    """Soft CE of the draft LM's next-token distribution against the target's top-k at every loss position
    (teacher position t = the distribution of x_{t+1}). Logits are built ``chunk_rows`` rows at a time under
    activation checkpointing, so no (rows x V) tensor lives through the backward."""
    h = model.model(  # type: ignore[operator]
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(), use_cache=False
    ).last_hidden_state
    m = batch["loss_mask"]
    rows, ids, p, top1 = h[m], batch["topk_ids"][m], batch["topk_p"][m], batch["top1"][m]
    w = model.get_output_embeddings().weight  # type: ignore[operator]

    def part(hc: torch.Tensor, ic: torch.Tensor, pc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logq = torch.log_softmax((hc @ w.T).float(), dim=-1)
        return -(pc * logq.gather(-1, ic)).sum(-1), logq.argmax(-1)

    ce, arg = [], []
    for s in range(0, rows.shape[0], chunk_rows):
        c, a = checkpoint(
            part,
            rows[s : s + chunk_rows],
            ids[s : s + chunk_rows],
            p[s : s + chunk_rows],
            use_reentrant=False,
        )
        ce.append(c)
        arg.append(a)
    count = max(1, rows.shape[0])
    loss = torch.cat(ce).sum() / count if ce else h.sum() * 0.0
    acc = float((torch.cat(arg) == top1).float().mean()) if arg else 0.0
    return loss, {"loss_0": float(loss.detach()), "acc_0": acc}


def dflash_loss(gamma: float, anchors_per_seq: int, seed: int) -> LossFn:
    """DFlash's SFT loss at random anchors in the response (`models/dflash.py: dflash_sft_loss`)."""
    from draft_opd_ray.models.dflash import dflash_sft_loss, sample_anchors

    g = torch.Generator().manual_seed(seed)

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        # collate marks teacher positions p >= prompt_len - 1; DFlash trains the tokens x_{p+1}
        tokens = F.pad(batch["loss_mask"][:, :-1], (1, 0)) & batch["attention_mask"]
        pos, valid = sample_anchors(tokens, anchors_per_seq, generator=g)
        return dflash_sft_loss(
            model,  # type: ignore[arg-type]
            batch["input_ids"],
            batch["features"],
            pos,
            anchor_valid=valid,
            loss_mask=tokens,
            attention_mask=batch["attention_mask"],
            gamma=gamma,
        )

    return loss


def dflash_train_flops(c: Any, batch: int, seq_len: int, anchors: int) -> float:
    """Forward + backward (3x forward) of a DFlash drafter at ``anchors`` blocks per sequence."""
    H, heads, d, kv = c.hidden_size, c.num_attention_heads, c.head_dim, c.num_key_value_heads
    layer_p = H * (heads * d + 2 * kv * d) + heads * d * H + 3 * H * c.intermediate_size
    q_rows = anchors * c.block_size
    fwd = c.num_layers * (
        2 * layer_p * q_rows + 4 * kv * d * H * seq_len + 4 * heads * d * q_rows * (seq_len + c.block_size)
    )
    fwd += 2 * len(c.target_layer_ids) * H * H * seq_len + 2 * H * c.vocab_size * anchors * (c.block_size - 1)
    return 3.0 * batch * float(fwd)


def _bt(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    B, T = batch["input_ids"].shape
    return int(B), int(T)


def _ttt_flops(
    c: Any, batch: dict[str, torch.Tensor], ttt_steps: int, anchors_of: Callable[..., Any]
) -> float:
    """TTT as the trainer runs it (``ttt_topk_loss``): step 0 over every padded row, the other steps and the
    LM head over the padded anchor rows."""
    from draft_opd_ray.flops import eagle3_block_flops

    B, T = batch["input_ids"].shape
    n = anchors_of(batch["loss_mask"], ttt_steps)[0].shape[1]
    return B * eagle3_block_flops(c, T, n, ttt_steps).total


def build_recipe(
    target: str | os.PathLike[str],
    draft: DraftConfig,
    *,
    seqs: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    init: str = "target",
    start_from: str | os.PathLike[str] | None = None,
    seed: int = 0,
    dflash_anchors: int = 64,
) -> Recipe:
    """The draft (fresh, or ``start_from`` an exported folder) and its recipe for ``draft.kind``."""
    from draft_opd_ray.flops import target_forward_flops
    from draft_opd_ray.models.target import read_target_info

    info = read_target_info(target)
    if draft.kind == "eagle3":
        from draft_opd_ray.models.eagle3 import init_eagle3, load_eagle3, save_eagle3
        from draft_opd_ray.sft.trainer import draft_vocab_counts, init_from_target, ttt_anchors, ttt_topk_loss

        vd = min(draft.draft_vocab_size, info.vocab_size)
        if start_from is not None:
            head = load_eagle3(start_from, target)
        else:
            counts = draft_vocab_counts(seqs, prompt_lens, info.vocab_size) if vd < info.vocab_size else None
            head = init_eagle3(
                target, aux_layer_ids=draft.aux_layer_ids, draft_vocab_size=vd, token_counts=counts, seed=seed
            )
            if init == "target":
                init_from_target(head, target)
            elif init != "random":
                raise ValueError(f"init must be 'target' or 'random', got {init!r}")
        head.lm_head.weight.requires_grad_(False)
        return Recipe(
            "eagle3",
            head,
            tuple(head.hidden_state_indices),
            head.draft_ids_in_target.clone(),
            lambda m, b: ttt_topk_loss(m, b, draft.ttt_steps, draft.ttt_decay),  # type: ignore[arg-type]
            lambda b: _ttt_flops(head.config, b, draft.ttt_steps, ttt_anchors),
            lambda m, out, t: save_eagle3(m, out, t),  # type: ignore[arg-type]
        )
    if draft.kind == "standalone":
        from draft_opd_ray.models.standalone import (
            build_standalone_from_target,
            load_standalone,
            save_standalone,
        )
        from draft_opd_ray.students import config_info

        if start_from is not None:
            lm = load_standalone(start_from, target)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                ids = standalone_layer_ids(draft.num_layers, info.num_layers)
                lm = load_standalone(build_standalone_from_target(target, tmp, layer_ids=ids), target)
        lm.train()
        return Recipe(
            "standalone",
            lm,
            (),
            torch.arange(info.vocab_size),
            standalone_kd_loss,
            lambda b: 3.0 * target_forward_flops(config_info(lm), *_bt(b)),
            lambda m, out, t: save_standalone(m, out, t),
        )
    if draft.kind == "dflash":
        from draft_opd_ray.models.dflash import init_dflash, load_dflash, save_dflash

        if start_from is not None:
            df = load_dflash(start_from, target)
        else:
            df = init_dflash(
                target,
                num_layers=draft.num_layers,
                block_size=draft.block_size,
                mask_token_id=draft.mask_token_id,
                seed=seed,
            )
        return Recipe(
            "dflash",
            df,
            tuple(df.hidden_state_indices),
            torch.arange(info.vocab_size),
            dflash_loss(draft.dflash_loss_gamma, dflash_anchors, seed),
            lambda b: dflash_train_flops(df.config, *_bt(b), min(dflash_anchors, _bt(b)[1])),
            lambda m, out, t: save_dflash(m, out, t),  # type: ignore[arg-type]
        )
    raise ValueError(f"draft.kind must be eagle3, standalone or dflash, got {draft.kind!r}")
