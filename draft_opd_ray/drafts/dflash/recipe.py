"""The DFlash SFT recipe (`drafts/recipe.py`): random anchors in the response, block CE weighted
exp(-(k-1)/gamma)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.drafts.dflash.model import DFlashDraft, init_dflash, load_dflash, save_dflash
from draft_opd_ray.drafts.recipe import LossFn, Recipe, RecipeInputs, Reduce, batch_shape
from draft_opd_ray.flops import dflash_forward_flops
from draft_opd_ray.models.target import read_target_info


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random SFT anchors: positions n >= 1 whose next token x_{n+1} is trained (loss_mask (B, L)).

    Returns anchor_pos (B, N) sorted (padded with 1) and anchor_valid (B, N) bool, N = num_anchors.
    """
    B, L = loss_mask.shape
    pos = torch.ones(B, num_anchors, dtype=torch.long)
    valid = torch.zeros(B, num_anchors, dtype=torch.bool)
    for b in range(B):
        cand = torch.nonzero(loss_mask[b, 2:].bool().cpu()).flatten() + 1  # n in [1, L-2], x_{n+1} trained
        pick = cand[torch.randperm(cand.numel(), generator=generator)[:num_anchors]].sort().values
        pos[b, : pick.numel()] = pick
        valid[b, : pick.numel()] = True
    return pos.to(loss_mask.device), valid.to(loss_mask.device)


def dflash_sft_loss(
    model: DFlashDraft,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    anchor_pos: torch.Tensor,
    *,
    anchor_valid: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    gamma: float = 7.0,
    chunk_rows: int = 2048,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted cross-entropy of every block offset o = 1..bs-1 against the committed token x_{n+o}, weight
    exp(-(o-1)/gamma), averaged over the valid (anchor valid, n+o < L, loss_mask) positions.

    Logits are produced ``chunk_rows`` rows at a time under activation checkpointing, so the (rows x V) tensor is
    never whole. Metrics: ``loss`` and ``acc_<o>`` (top-1 accuracy per offset). ``reduce``: see
    :class:`LossFn` (the weight sum and the per-offset counts are reduced).
    """
    B, L = input_ids.shape
    bs = model.config.block_size
    hidden = model(input_ids, features, anchor_pos, attention_mask=attention_mask)[
        :, :, 1:
    ]  # (B, N, bs-1, H)
    pos = anchor_pos[..., None] + torch.arange(1, bs, device=input_ids.device)  # (B, N, bs-1)
    inside = pos < L
    flat = pos.clamp(max=L - 1).flatten(1)
    labels = torch.gather(input_ids, 1, flat).view_as(pos)
    keep = inside
    if loss_mask is not None:
        keep = keep & torch.gather(loss_mask.bool(), 1, flat).view_as(pos)
    if anchor_valid is not None:
        keep = keep & anchor_valid[..., None]
    decay = torch.exp(-torch.arange(bs - 1, device=input_ids.device, dtype=torch.float32) / gamma)
    w = keep.float() * decay

    def rows(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model.logits(h).float()
        return F.cross_entropy(logits, y, reduction="none"), (logits.argmax(-1) == y).float()

    h_flat, y_flat = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    ce_parts, hit_parts = [], []
    for s in range(0, h_flat.shape[0], chunk_rows):
        ce, hit = checkpoint(
            rows, h_flat[s : s + chunk_rows], y_flat[s : s + chunk_rows], use_reentrant=False
        )
        ce_parts.append(ce)
        hit_parts.append(hit)
    ce_all = torch.cat(ce_parts).view_as(w)
    dens = torch.cat([w.sum()[None], keep.float().sum(dim=(0, 1))])  # (bs,) weight sum, count per offset
    if reduce is not None:
        dens = reduce(dens)
    loss = (ce_all * w).sum() / dens[0].clamp_min(1e-6)
    with torch.no_grad():
        hits = torch.cat(hit_parts).view_as(w) * keep
        counts = dens[1:].clamp_min(1)
        metrics = {"loss": float(loss)} | {
            f"acc_{o + 1}": float(v) for o, v in enumerate(hits.sum((0, 1)) / counts)
        }
    return loss, metrics


def dflash_loss(gamma: float, anchors_per_seq: int, seed: int) -> LossFn:
    """DFlash's SFT loss at random anchors in the response (:func:`dflash_sft_loss`)."""
    g = torch.Generator().manual_seed(seed)

    def loss(
        model: nn.Module, batch: dict[str, torch.Tensor], *, reduce: Reduce | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
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
            reduce=reduce,
        )

    return loss


def dflash_recipe(
    target: str | os.PathLike[str], draft: DraftConfig, src: RecipeInputs, anchors: int = 64
) -> Recipe:
    info = read_target_info(target)
    if src.start_from is not None:
        df = load_dflash(src.start_from, target)
    else:
        df = init_dflash(
            target,
            num_layers=draft.num_layers,
            block_size=draft.block_size,
            mask_token_id=draft.mask_token_id,
            seed=src.seed,
        )

    def flops(b: dict[str, torch.Tensor]) -> float:
        B, T = batch_shape(b)
        return 3.0 * B * dflash_forward_flops(df.config, T, min(anchors, T), df.config.block_size - 1)

    return Recipe(
        "dflash",
        df,
        tuple(df.hidden_state_indices),
        torch.arange(info.vocab_size),
        dflash_loss(draft.dflash_loss_gamma, anchors, src.seed),
        flops,
        lambda m, out, t: save_dflash(m, out, t),  # type: ignore[arg-type]
    )


recipe = dflash_recipe  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
