"""EAGLE-3 head: TTT unrolling and replay forward against a sequential (vLLM-style KV-cache) simulation written
with explicit loops, shifted TTT targets, the vocabulary map, the default aux layers, checkpoint round trip and
target checks. (Serving the exported head in vLLM: tests/integration/test_serve_vllm.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draft_opd_ray.drafts.eagle3.model import (
    Eagle3Config,
    Eagle3Draft,
    build_vocab_map,
    default_aux_layer_ids,
    draft_to_target,
    eagle3_ttt_loss,
    init_eagle3,
    load_eagle3,
    save_eagle3,
    target_to_draft,
)
from draft_opd_ray.errors import ModelError
from tests.helpers import edit_config, randomize_, rope, save_checked_against_its_target, small_shape

V, H = 64, 32


def small_head(draft_vocab: int = 24, seed: int = 0) -> Eagle3Draft:
    """A head on a synthetic 64-token, 2-layer-aux target: fast, and sharp enough that bugs change logits."""
    torch.manual_seed(seed)
    c = Eagle3Config(**small_shape(H, V), draft_vocab_size=draft_vocab, aux_layer_ids=(1, 3))
    m = Eagle3Draft(c, torch.randn(V, H))
    randomize_(m, 0.3)
    m.set_vocab_map(*build_vocab_map(torch.rand(V), draft_vocab))
    return m.eval()


# --------------------------------------------------------------------------------------------------
# Sequential reference: one query at a time over an explicit KV list, as vLLM runs the head
# --------------------------------------------------------------------------------------------------


def _step(m: Eagle3Draft, tok: int, hidden: torch.Tensor, pos: int, cache: list) -> torch.Tensor:
    """Append this token's key/value to ``cache`` and attend over the whole cache; returns the pre-norm output."""
    c, L = m.config, m.midlayer
    x = torch.cat([L.input_layernorm(m.embed_tokens.weight[tok]), L.hidden_norm(hidden)])
    q = rope(L.self_attn.q_proj(x).view(c.num_attention_heads, c.head_dim), pos, c.rope_theta)
    k = rope(L.self_attn.k_proj(x).view(c.num_key_value_heads, c.head_dim), pos, c.rope_theta)
    cache.append((k, L.self_attn.v_proj(x).view(c.num_key_value_heads, c.head_dim)))
    rep = c.num_attention_heads // c.num_key_value_heads
    heads = []
    for h in range(c.num_attention_heads):
        scores = torch.stack([(q[h] * kk[h // rep]).sum() / math.sqrt(c.head_dim) for kk, _ in cache])
        w = torch.softmax(scores, 0)
        heads.append(sum(w[j] * vv[h // rep] for j, (_, vv) in enumerate(cache)))
    out = hidden + L.self_attn.o_proj(torch.cat(heads))
    return out + L.mlp(L.post_attention_layernorm(out))


def sequential_chain(
    m: Eagle3Draft, ids: list[int], feats: torch.Tensor, anchor: int, fed: list[int]
) -> list[torch.Tensor]:
    """Draft after the verified prefix x_0..x_anchor: step-0 rows 0..anchor-1 (row r = (f_r, x_{r+1}) at position
    r) fill the cache; then one step per fed token at positions anchor, anchor+1, ...; returns logits per step."""
    cache: list = []
    h = torch.zeros(H)
    for r in range(anchor):
        h = _step(m, ids[r + 1], m.fc(feats[r]), r, cache)
    out = [m.logits(h)]
    for j, tok in enumerate(fed, start=1):
        h = _step(m, tok, h, anchor - 1 + j, cache)
        out.append(m.logits(h))
    return out


@torch.no_grad()
def test_ttt_unroll_matches_sequential_inference() -> None:
    """Step i row t = a chain anchored at x_{t+1} fed the true tokens: it sees step-0 keys of rows <= t and its
    own steps 1..i at rotary positions t+1..t+i (SpecForge after PR #244, and vLLM)."""
    m = small_head()
    B, T, steps = 2, 7, 3
    ids = torch.randint(0, V, (B, T))
    feats = torch.randn(B, T, 2 * H)
    out = m(ids, feats, ttt_steps=steps)
    assert [o.shape for o in out] == [(B, T, m.config.draft_vocab_size)] * steps
    for b in range(B):
        for t in range(T - 1):
            fed = [int(x) for x in ids[b, t + 2 : t + steps + 1]]
            ref = sequential_chain(m, ids[b].tolist(), feats[b], t + 1, fed)
            for i, logits in enumerate(ref):
                torch.testing.assert_close(out[i][b, t], logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_ttt_right_padding_does_not_change_real_rows() -> None:
    m = small_head()
    ids, feats = torch.randint(0, V, (1, 6)), torch.randn(1, 6, 2 * H)
    pad_ids = torch.cat([ids, torch.randint(0, V, (1, 3))], 1)
    pad_feats = torch.cat([feats, torch.randn(1, 3, 2 * H)], 1)
    mask = torch.tensor([[1] * 6 + [0] * 3])
    a, b = m(ids, feats, ttt_steps=3), m(pad_ids, pad_feats, ttt_steps=3, attention_mask=mask)
    for i in range(3):  # rows whose tokens are all real
        torch.testing.assert_close(a[i][:, : 6 - i - 1], b[i][:, : 6 - i - 1], rtol=1e-5, atol=1e-5)


def test_ttt_loss_uses_shifted_teacher_positions() -> None:
    m = small_head()
    B, T, steps = 2, 6, 3
    ids, feats = torch.randint(0, V, (B, T)), torch.randn(B, T, 2 * H)
    teacher = torch.randn(B, T, V) * 3
    loss_mask = torch.rand(B, T) > 0.3
    loss, metrics = eagle3_ttt_loss(m, ids, feats, teacher, loss_mask, ttt_steps=steps, decay=0.8)
    with torch.no_grad():
        out = m(ids, feats, ttt_steps=steps)
    ids_d = m.draft_ids_in_target
    expected = 0.0
    for i in range(steps):
        terms = []
        for b in range(B):
            for t in range(T):
                p = t + i + 1  # teacher position of step i row t
                if p < T and loss_mask[b, p]:
                    target = torch.softmax(teacher[b, p, ids_d], 0)
                    terms.append(-(target * torch.log_softmax(out[i][b, t], 0)).sum())
        step_loss = torch.stack(terms).mean()
        assert metrics[f"loss_{i}"] == pytest.approx(float(step_loss), rel=1e-4)
        expected += 0.8**i * float(step_loss)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-4)
    loss.backward()
    assert m.fc.weight.grad is not None and m.embed_tokens.weight.grad is None  # embedding frozen


@torch.no_grad()
def test_block_logits_match_sequential_drafting_for_many_anchors() -> None:
    m = small_head()
    B, T, K = 2, 9, 4
    ids, feats = torch.randint(0, V, (B, T)), torch.randn(B, T, 2 * H)
    anchors = torch.tensor([[1, 4, 8], [2, 3, 6]])
    drafted = torch.randint(0, V, (B, 3, K))
    got = m.block_logits(ids, feats, anchors, drafted)
    assert got.shape == (B, 3, K, m.config.draft_vocab_size)
    for b in range(B):
        for a in range(3):
            n = int(anchors[b, a])
            fed = [int(x) for x in drafted[b, a, : K - 1]]
            ref = sequential_chain(m, ids[b].tolist(), feats[b], n, fed)
            torch.testing.assert_close(got[b, a], torch.stack(ref), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_propose_is_greedy_drafting_in_target_ids() -> None:
    m = small_head()
    ids, feats = torch.randint(0, V, (2, 8)), torch.randn(2, 8, 2 * H)
    lengths = torch.tensor([5, 8])
    drafted, q = m.propose(ids, feats, lengths, num_speculative_tokens=3)
    assert drafted.shape == (2, 3) and q.shape == (2, 3, V)
    assert bool(m.t2d[drafted].all())  # only draft-vocabulary ids are proposed
    for b in range(2):
        n = int(lengths[b]) - 1
        logits = m.block_logits(
            ids[b : b + 1], feats[b : b + 1], torch.tensor([[n]]), drafted[b : b + 1, None]
        )
        expect = m.draft_ids_in_target[logits[0, 0].argmax(-1)]
        assert drafted[b].tolist() == expect.tolist()
        assert torch.equal(q[b].argmax(-1), drafted[b]) and torch.equal(q[b].sum(-1), torch.ones(3))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    s1, _ = m.propose(ids, feats, lengths, num_speculative_tokens=3, temperature=1.0, generator=g1)
    s2, _ = m.propose(ids, feats, lengths, num_speculative_tokens=3, temperature=1.0, generator=g2)
    assert torch.equal(s1, s2)


# --------------------------------------------------------------------------------------------------
# Vocabulary map
# --------------------------------------------------------------------------------------------------


def test_vocab_map_round_trip_and_frequency_order() -> None:
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3, 2, 9])
    d2t, t2d = build_vocab_map(counts, 4, always_include=[6])
    chosen = torch.arange(4) + d2t
    assert chosen.tolist() == [2, 3, 6, 9]  # forced 6, then counts 9, 9, 9 (ties: lower ids first)
    assert t2d.tolist() == [i in (2, 3, 6, 9) for i in range(10)]
    assert torch.equal(draft_to_target(torch.arange(4), d2t), chosen)
    assert torch.equal(target_to_draft(chosen, t2d), torch.arange(4))
    assert target_to_draft(torch.tensor([0, 1]), t2d).tolist() == [-1, -1]
    big = torch.randint(0, 1000, (5000,))
    d2t, t2d = build_vocab_map(big, 300)
    ids = torch.arange(300) + d2t
    assert bool((ids[1:] > ids[:-1]).all()) and int(t2d.sum()) == 300
    assert torch.equal(target_to_draft(draft_to_target(torch.arange(300), d2t), t2d), torch.arange(300))
    assert big[ids].min() >= big[~t2d].max()  # the most frequent ids
    with pytest.raises(ModelError, match="draft_vocab_size"):
        build_vocab_map(counts, 11)


# --------------------------------------------------------------------------------------------------
# Checkpoint round trip and target checks (tiny target with the embedded tokenizer)
# --------------------------------------------------------------------------------------------------


VLLM_KEYS = {
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
}


def test_export_load_identical_logits(tiny_target: Path, tmp_path: Path) -> None:
    counts = torch.randint(0, 50, (49152,))
    m = init_eagle3(tiny_target, draft_vocab_size=512, token_counts=counts, lm_head_from_target=True)
    assert m.config.aux_layer_ids == (1, 2, 3) and bool(m.t2d[2])  # eos is always in the draft vocabulary
    save_eagle3(m, tmp_path / "d", tiny_target)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["vocab_size"]) == (512, 64, 49152)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as fh:
        assert set(fh.keys()) == VLLM_KEYS
        assert fh.get_tensor("d2t").dtype == torch.int64 and fh.get_tensor("t2d").dtype == torch.bool
    loaded = load_eagle3(tmp_path / "d", tiny_target)
    ids, feats = torch.randint(0, 49152, (2, 10)), torch.randn(2, 10, 3 * 64)
    with torch.no_grad():
        for a, b in zip(m(ids, feats, ttt_steps=3), loaded(ids, feats, ttt_steps=3), strict=True):
            assert torch.equal(a, b)
    with pytest.raises(ModelError, match="target_path"):
        load_eagle3(tmp_path / "d")  # no embedding in the checkpoint and no target to take it from
    save_eagle3(m, tmp_path / "e", tiny_target, include_embeddings=True)
    assert torch.equal(load_eagle3(tmp_path / "e").embed_tokens.weight, m.embed_tokens.weight)


def test_default_aux_layers_are_low_middle_and_last_input(tiny_target: Path) -> None:
    """(2, L/2, L-1) (not vLLM's L-3: the last layers of a small model carry most of its next-token prediction);
    evenly spread ids for a target too shallow for it."""
    assert default_aux_layer_ids(30) == (2, 15, 29)
    assert default_aux_layer_ids(32) == (2, 16, 31)
    assert default_aux_layer_ids(4) == (1, 2, 3)
    assert default_aux_layer_ids(3) == (1, 2)
    assert init_eagle3(tiny_target).config.aux_layer_ids == default_aux_layer_ids(4)


def test_full_vocabulary_head_has_no_id_map(tiny_target: Path, tmp_path: Path) -> None:
    m = init_eagle3(tiny_target)
    save_eagle3(m, tmp_path / "d", tiny_target)
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as fh:
        assert not {"d2t", "t2d"} & set(fh.keys())  # vLLM builds no map when Vd == V
    assert torch.equal(load_eagle3(tmp_path / "d", tiny_target).draft_ids_in_target, torch.arange(49152))


def test_mismatched_drafts_are_rejected(tiny_target: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"out of range \[0, 4\)"):
        init_eagle3(tiny_target, aux_layer_ids=(1, 2, 4))
    with pytest.raises(ModelError, match="strictly increasing"):
        init_eagle3(tiny_target, aux_layer_ids=(3, 1, 2))
    with pytest.raises(ModelError, match="token_counts"):
        init_eagle3(tiny_target, draft_vocab_size=100)
    d = save_checked_against_its_target(
        save_eagle3, load_eagle3, init_eagle3(tiny_target), tmp_path / "d", tiny_target
    )
    edit_config(d, lambda c: c.update(vocab_size=32000))
    with pytest.raises(ModelError, match="vocab_size 32000 != target vocab_size 49152"):
        load_eagle3(d, tiny_target)
    edit_config(d, lambda c: c.update(architectures=["LlamaForCausalLM"]))  # and still vocab_size 32000
    with pytest.raises(ModelError, match="LlamaForCausalLMEagle3"):
        load_eagle3(d, tiny_target)
