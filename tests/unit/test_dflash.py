"""DFlash drafter: the many-anchor block mask against brute force, block isolation and "context strictly before
the anchor", the forward against explicit per-head attention loops, the SFT loss weights
(`drafts/dflash/recipe.py`), checkpoint round trip and target checks. (Serving the exported drafter in vLLM:
tests/integration/test_serve_vllm.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from draft_opd_ray.drafts.dflash.model import (
    DFlashConfig,
    DFlashDraft,
    default_mask_token_id,
    dflash_attention_mask,
    init_dflash,
    load_dflash,
    save_dflash,
)
from draft_opd_ray.drafts.dflash.recipe import dflash_sft_loss, sample_anchors
from draft_opd_ray.errors import ModelError
from tests.helpers import edit_config, randomize_, rope, save_checked_against_its_target, small_shape

V, H, BS = 64, 32, 4


def small_drafter(seed: int = 0) -> DFlashDraft:
    torch.manual_seed(seed)
    c = DFlashConfig(
        **small_shape(H, V), num_layers=2, block_size=BS, mask_token_id=V - 1, target_layer_ids=(1, 2)
    )
    m = DFlashDraft(c, torch.randn(V, H), torch.randn(V, H))
    randomize_(m, 0.3)
    return m.eval()


def test_block_mask_matches_brute_force() -> None:
    B, N, L, bs = 2, 3, 9, 4
    anchors = torch.tensor([[0, 4, 8], [3, 3, 7]])
    valid = torch.rand(B, L) > 0.2
    got = dflash_attention_mask(anchors, L, bs, valid)
    assert got.shape == (B, N * bs, L + N * bs)
    for b in range(B):
        for q in range(N * bs):
            for k in range(L + N * bs):
                if k < L:  # context: strictly before the query's anchor, and not padding
                    want = k < int(anchors[b, q // bs]) and bool(valid[b, k])
                else:  # block tokens: the whole own block, both directions; other blocks never
                    want = (k - L) // bs == q // bs
                assert bool(got[b, q, k]) == want, (b, q, k)


@torch.no_grad()
def test_blocks_are_isolated_and_see_only_context_before_the_anchor() -> None:
    m = small_drafter()
    L = 10
    ids, feats = torch.randint(0, V, (1, L)), torch.randn(1, L, 2 * H)
    anchors = torch.tensor([[2, 5, 9]])
    together = m(ids, feats, anchors)
    assert together.shape == (1, 3, BS, H)
    for a in range(3):
        n = int(anchors[0, a])
        alone = m(ids[:, : n + 1], feats[:, : n + 1], anchors[:, a : a + 1])  # nothing after x_n exists
        torch.testing.assert_close(together[:, a], alone[:, 0], rtol=1e-5, atol=1e-5)
        changed = feats.clone()
        changed[:, n:] += 1.0  # the anchor's own feature and everything after it
        torch.testing.assert_close(
            m(ids, changed, anchors[:, a : a + 1])[:, 0], alone[:, 0], rtol=1e-5, atol=1e-5
        )
        if n > 0:
            changed[:, n - 1] += 1.0  # the feature just before the anchor is context
            assert not torch.allclose(m(ids, changed, anchors[:, a : a + 1])[:, 0], alone[:, 0])


@torch.no_grad()
def reference_block(m: DFlashDraft, ids: torch.Tensor, feats: torch.Tensor, n: int) -> torch.Tensor:
    """One block by explicit loops: context rows 0..n-1 (hidden_norm(fc(f)), no input_layernorm) and the block
    [x_n, MASK...] as keys of every layer; every block token attends to all of them. Returns (bs, H)."""
    c = m.config
    ctx = [m.hidden_norm(m.fc(feats[t])) for t in range(n)]
    x = [m.embed_tokens.weight[int(ids[n])]] + [m.embed_tokens.weight[c.mask_token_id]] * (c.block_size - 1)
    rep = c.num_attention_heads // c.num_key_value_heads
    layer: Any
    for layer in m.layers:
        a = layer.self_attn
        normed = [layer.input_layernorm(v) for v in x]
        rows = [(v, t) for t, v in enumerate(ctx)] + [(v, n + o) for o, v in enumerate(normed)]
        keys = [rope(a.k_norm(a.k_proj(v).view(-1, c.head_dim)), p, c.rope_theta) for v, p in rows]
        vals = [a.v_proj(v).view(-1, c.head_dim) for v, _ in rows]
        new = []
        for o, v in enumerate(normed):
            q = rope(a.q_norm(a.q_proj(v).view(-1, c.head_dim)), n + o, c.rope_theta)
            heads = []
            for h in range(c.num_attention_heads):
                s = torch.stack([(q[h] * k[h // rep]).sum() / math.sqrt(c.head_dim) for k in keys])
                w = torch.softmax(s, 0)
                heads.append(sum(w[j] * vals[j][h // rep] for j in range(len(vals))))
            y = x[o] + a.o_proj(torch.cat(heads))
            new.append(y + layer.mlp(layer.post_attention_layernorm(y)))
        x = new
    return torch.stack([m.norm(v) for v in x])


@torch.no_grad()
def test_forward_matches_explicit_attention_loops() -> None:
    m = small_drafter()
    ids, feats = torch.randint(0, V, (2, 8)), torch.randn(2, 8, 2 * H)
    anchors = torch.tensor([[1, 6], [0, 4]])
    got = m(ids, feats, anchors)
    for b in range(2):
        for a in range(2):
            ref = reference_block(m, ids[b], feats[b], int(anchors[b, a]))
            torch.testing.assert_close(got[b, a], ref, rtol=1e-4, atol=1e-4)


def test_sft_loss_weights_offsets_by_exp_decay() -> None:
    m = small_drafter().train()
    B, L, gamma = 2, 9, 7.0
    ids, feats = torch.randint(0, V, (B, L)), torch.randn(B, L, 2 * H)
    anchors = torch.tensor([[1, 4, 7], [2, 6, 1]])
    anchor_valid = torch.tensor([[True, True, True], [True, True, False]])
    loss_mask = torch.rand(B, L) > 0.2
    loss, metrics = dflash_sft_loss(
        m, ids, feats, anchors, anchor_valid=anchor_valid, loss_mask=loss_mask, gamma=gamma, chunk_rows=5
    )
    with torch.no_grad():
        logits = m.logits(m(ids, feats, anchors))
    num = den = 0.0
    for b in range(B):
        for a in range(3):
            for o in range(1, BS):
                p = int(anchors[b, a]) + o
                if anchor_valid[b, a] and p < L and loss_mask[b, p]:
                    w = math.exp(-(o - 1) / gamma)
                    num += w * float(torch.nn.functional.cross_entropy(logits[b, a, o], ids[b, p]))
                    den += w
    assert float(loss.detach()) == pytest.approx(num / den, rel=1e-5)
    assert set(metrics) == {"loss", "acc_1", "acc_2", "acc_3"}
    loss.backward()
    first: Any = m.layers[0]
    assert m.fc.weight.grad is not None and first.self_attn.k_norm.weight.grad is not None
    assert m.embed_tokens.weight.grad is None and m.lm_head.weight.grad is None  # target's, frozen


def test_sample_anchors_pick_trained_positions() -> None:
    loss_mask = torch.zeros(2, 12, dtype=torch.bool)
    loss_mask[0, 5:] = True
    loss_mask[1, 10] = True
    pos, valid = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(0))
    assert valid[0].all() and valid[1].tolist() == [True, False, False, False] and pos[1, 0] == 9
    for n in pos[0].tolist():
        assert 4 <= n <= 10 and loss_mask[0, n + 1]
    assert pos[0].tolist() == sorted(pos[0].tolist()) and len(set(pos[0].tolist())) == 4


@torch.no_grad()
def test_propose_takes_block_offsets_after_the_last_token() -> None:
    m = small_drafter()
    ids, feats = torch.randint(0, V, (2, 8)), torch.randn(2, 8, 2 * H)
    lengths = torch.tensor([5, 8])
    drafted, q = m.propose(ids, feats, lengths)
    assert drafted.shape == (2, BS - 1) and q.shape == (2, BS - 1, V)
    for b in range(2):
        n = int(lengths[b]) - 1
        logits = m.logits(m(ids[b : b + 1, : n + 1], feats[b : b + 1, : n + 1], torch.tensor([[n]])))
        assert drafted[b].tolist() == logits[0, 0, 1:].argmax(-1).tolist()


# --------------------------------------------------------------------------------------------------
# Checkpoint round trip and target checks
# --------------------------------------------------------------------------------------------------


def test_export_load_identical_logits(tiny_target: Path, tmp_path: Path) -> None:
    m = init_dflash(tiny_target, num_layers=2, block_size=8)
    assert m.config.mask_token_id == default_mask_token_id(tiny_target) == 49151  # ordinary, not special
    assert m.config.target_layer_ids == (0, 2) and m.hidden_state_indices == (1, 3)
    save_dflash(m, tmp_path / "d", tiny_target)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["dflash_config"] == {
        "mask_token_id": 49151,
        "target_layer_ids": [0, 2],
    }
    assert cfg["layer_types"] == ["full_attention", "full_attention"]  # non-causal blocks in vLLM
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
    per_layer = {
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    }
    assert keys == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{k}" for i in range(2) for k in per_layer
    }
    loaded = load_dflash(tmp_path / "d", tiny_target)
    ids, feats, anchors = (
        torch.randint(0, 49152, (2, 12)),
        torch.randn(2, 12, 128),
        torch.tensor([[3, 9], [1, 5]]),
    )
    with torch.no_grad():
        assert torch.equal(m.logits(m(ids, feats, anchors)), loaded.logits(loaded(ids, feats, anchors)))


def test_mismatched_drafts_are_rejected(tiny_target: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="mask_token_id 2 is a special token"):
        init_dflash(tiny_target, mask_token_id=2)  # eos
    with pytest.raises(ModelError, match=r"\[3\] out of range \[0, 3\)"):
        init_dflash(tiny_target, num_layers=2, target_layer_ids=(0, 3))  # output of the last layer
    with pytest.raises(ModelError, match="strictly increasing"):
        init_dflash(tiny_target, num_layers=2, target_layer_ids=(2, 0))
    d = save_checked_against_its_target(
        save_dflash, load_dflash, init_dflash(tiny_target), tmp_path / "d", tiny_target
    )
    edit_config(d, lambda c: c["dflash_config"].update(mask_token_id=0))
    with pytest.raises(ModelError, match="special token"):
        load_dflash(d, tiny_target)
