"""Data-parallel SFT without Ray or DeepSpeed: every recipe's loss on shares of a batch, each normalised by the
global batch's counts (the recipe's ``reduce``), adds up to the whole batch's loss, gradients and metrics, an
empty share (a masked copy, as the trainer runs it) included; masks of a batch and the SFT ranks' threads.
(The same on real Ray actors and DeepSpeed: tests/integration/test_sft_ranks.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.drafts.dflash.recipe import dflash_sft_loss
from draft_opd_ray.drafts.recipe import RecipeInputs
from draft_opd_ray.drafts.registry import draft_kind
from draft_opd_ray.sft.features import SeqFeatures
from draft_opd_ray.sft.ranks import rank_threads
from draft_opd_ray.sft.trainer import collate, mask_batch

LENGTHS, PROMPTS = (20, 13, 17), (7, 2, 5)
SHARES = ([0, 2], [1], [])  # the last rank has no sequence of its own


def _items(width: int, vocab: int) -> list[SeqFeatures]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n, p in zip(LENGTHS, PROMPTS):
        ids = torch.randint(3, 300, (n,), generator=g)
        topk_p = torch.softmax(torch.randn(n, 4, generator=g), -1)
        out.append(
            SeqFeatures(
                ids,
                p,
                torch.randn(n, width, generator=g),
                torch.randint(0, vocab, (n, 4), generator=g),
                topk_p,
                ids,
            )
        )
    return out


def _share(items: list[SeqFeatures], share: list[int]) -> dict[str, torch.Tensor]:
    b = collate([items[i] for i in share] or items[:1], torch.float32)
    if not share:
        b["loss_mask"].zero_()
    return b


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _check_shares_add_up(
    model: torch.nn.Module, loss_fn: Callable[..., Any], items: list[SeqFeatures]
) -> None:
    model.zero_grad()
    whole, m_whole = loss_fn(collate(items, torch.float32), None)
    whole.backward()
    g_whole = _grads(model)
    # what reduce sums: each share's denominators (one reduce call per loss), then the sum on every share
    local: list[torch.Tensor] = []
    for s in SHARES:
        loss_fn(_share(items, s), lambda t: local.append(t.clone()) or t)
    total = torch.stack(local).sum(0)
    model.zero_grad()
    loss, metrics = torch.zeros(()), {k: 0.0 for k in m_whole}
    for s in SHARES:
        part, m = loss_fn(_share(items, s), lambda t: total.clone())
        part.backward()
        loss = loss + part.detach()
        assert set(m) == set(m_whole)
        metrics = {k: v + m[k] for k, v in metrics.items()}
    torch.testing.assert_close(loss, whole.detach(), atol=1e-6, rtol=1e-5)
    assert metrics == pytest.approx(m_whole, rel=1e-5, abs=1e-6)
    for a, b in zip(_grads(model), g_whole):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("kind", ["eagle3", "standalone"])
def test_shares_add_up_to_the_whole_batch(tiny_target: Path, kind: str) -> None:
    draft = DraftConfig(kind=kind, draft_vocab_size=256, ttt_steps=3, num_layers=2)
    seqs = [it.input_ids.tolist() for it in _items(0, 1)]
    recipe = draft_kind(draft.kind).recipe(tiny_target, draft, RecipeInputs(seqs, PROMPTS))
    width = len(recipe.feature_ids) * 64
    items = _items(width, len(recipe.label_ids))
    _check_shares_add_up(recipe.model, lambda b, r: recipe.loss(recipe.model, b, reduce=r), items)


def test_dflash_shares_add_up_to_the_whole_batch(tiny_target: Path) -> None:
    """At given anchors (DFlash's SFT samples them per rank: statistically, not exactly, one rank's)."""
    draft = DraftConfig(kind="dflash", num_layers=1, block_size=4, num_speculative_tokens=3)
    recipe = draft_kind(draft.kind).recipe(tiny_target, draft, RecipeInputs([[5] * 20], [2]))
    items = _items(len(recipe.feature_ids) * 64, 8)

    def loss(b: dict[str, torch.Tensor], reduce: Any) -> Any:
        B = b["input_ids"].shape[0]
        pos = torch.tensor([[3, 6, 9]] * B)
        valid = torch.ones(B, 3, dtype=torch.bool)
        return dflash_sft_loss(
            recipe.model,  # type: ignore[arg-type]
            b["input_ids"],
            b["features"],
            pos,
            anchor_valid=valid,
            loss_mask=b["loss_mask"],
            attention_mask=b["attention_mask"],
            reduce=reduce,
        )

    _check_shares_add_up(recipe.model, loss, items)


def test_mask_batch_holds_the_masks_collate_makes() -> None:
    items = _items(2, 8)
    b, m = collate(items, torch.float32), mask_batch(list(LENGTHS), list(PROMPTS))
    assert set(m) == {"input_ids", "attention_mask", "loss_mask"}
    assert torch.equal(m["attention_mask"], b["attention_mask"]) and torch.equal(
        m["loss_mask"], b["loss_mask"]
    )
    assert m["input_ids"].shape == b["input_ids"].shape


def test_rank_threads_share_each_nodes_cores() -> None:
    assert rank_threads([("a", 2)]) == [2]
    assert rank_threads([("a", 16), ("a", 16), ("b", 8)]) == [8, 8, 8]
    assert rank_threads([("a", 2), ("a", 2), ("a", 2)]) == [1, 1, 1]
