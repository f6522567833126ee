"""DFlash drafter: the many-anchor block mask against brute force, block isolation and "context strictly before
the anchor", the forward against explicit per-head attention loops, the SFT loss weights, checkpoint round trip and
target checks, and (marked ``vllm``) serving the exported drafter with vLLM's CPU speculative decoding."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from draft_opd_ray.errors import ModelError
from draft_opd_ray.models.dflash import (
    DFlashConfig,
    DFlashDraft,
    default_mask_token_id,
    dflash_attention_mask,
    dflash_sft_loss,
    init_dflash,
    load_dflash,
    sample_anchors,
    save_dflash,
)
from draft_opd_ray.models.target import ensure_embedded_target
from draft_opd_ray.models.tiny import build_tiny_target

V, H, BS = 64, 32, 4


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny matrices: OpenMP hand-offs cost more than the math on a 2-core box (and vLLM needs the other core)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def small_drafter(seed: int = 0) -> DFlashDraft:
    torch.manual_seed(seed)
    c = DFlashConfig(
        hidden_size=H,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=V,
        block_size=BS,
        mask_token_id=V - 1,
        target_layer_ids=(1, 2),
        rope_theta=100.0,
    )
    m = DFlashDraft(c, torch.randn(V, H), torch.randn(V, H))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2 and p.requires_grad:
                p.normal_(0, 0.3)
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


def _rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:  # x (heads, d)
    d = x.shape[-1]
    out = x.clone()
    for j in range(d // 2):
        ang = pos / theta ** (2 * j / d)
        a, b = x[:, j], x[:, j + d // 2]
        out[:, j] = a * math.cos(ang) - b * math.sin(ang)
        out[:, j + d // 2] = b * math.cos(ang) + a * math.sin(ang)
    return out


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
        keys = [_rope(a.k_norm(a.k_proj(v).view(-1, c.head_dim)), p, c.rope_theta) for v, p in rows]
        vals = [a.v_proj(v).view(-1, c.head_dim) for v, _ in rows]
        new = []
        for o, v in enumerate(normed):
            q = _rope(a.q_norm(a.q_proj(v).view(-1, c.head_dim)), n + o, c.rope_theta)
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


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_target(
        tmp_path_factory.mktemp("df") / "target", tokenizer_from=ensure_embedded_target()
    )


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
    other = build_tiny_target(tmp_path / "wide", tokenizer_from=tiny_target, hidden=96, heads=3, kv_heads=1)
    m = init_dflash(tiny_target)
    with pytest.raises(ModelError, match="hidden_size 64 != target hidden_size 96"):
        save_dflash(m, tmp_path / "d", other)
    save_dflash(m, tmp_path / "d", tiny_target)
    with pytest.raises(ModelError, match="hidden_size 64 != target hidden_size 96"):
        load_dflash(tmp_path / "d", other)
    cfg_path = tmp_path / "d" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dflash_config"]["mask_token_id"] = 0
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="special token"):
        load_dflash(tmp_path / "d", tiny_target)


# --------------------------------------------------------------------------------------------------
# vLLM CPU speculative decoding (slow)
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_spec_decode(target, draft: DFlashDraft, prompt: list[int], max_tokens: int):
    """Greedy DFlash speculative decoding in PyTorch: (output ids, accepted drafted tokens per step)."""
    k = draft.config.block_size - 1
    seq = prompt + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]
    accepted: list[int] = []
    while len(seq) - len(prompt) < max_tokens:
        hs = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i] for i in draft.hidden_state_indices], dim=-1)
        block = draft.propose(torch.tensor([seq]), feats, torch.tensor([len(seq)]))[0][0].tolist()
        greedy = target(torch.tensor([seq + block])).logits[0, len(seq) - 1 :].argmax(-1).tolist()
        a = 0
        while a < k and block[a] == greedy[a]:
            a += 1
        accepted.append(a)
        seq += block[:a] + [greedy[a]]
    return seq[len(prompt) : len(prompt) + max_tokens], accepted


def copying_drafter(target_path: Path) -> DFlashDraft:
    """A drafter whose mask slots drift from the mask token towards the token that dominates the context as
    generation goes on: acceptance then depends on the exact context (positions < anchor), RoPE and norms."""
    m = init_dflash(target_path, num_layers=2, block_size=8, target_layer_ids=(0, 2))
    g = torch.Generator().manual_seed(0)
    layer: Any
    with torch.no_grad():
        m.fc.weight.zero_()
        m.fc.weight[:, :64] = torch.eye(64)  # context ~ output of target layer 0 ~ the token's embedding
        for layer in m.layers:
            a = layer.self_attn
            a.q_proj.weight.copy_(torch.randn(a.q_proj.weight.shape, generator=g))
            a.k_proj.weight.copy_(torch.randn(a.k_proj.weight.shape, generator=g))
            a.q_norm.weight.fill_(2.0)
            a.v_proj.weight.copy_(torch.eye(64))
            a.o_proj.weight.copy_(torch.cat([torch.eye(64), torch.eye(64)], 1) * 0.03)
            layer.mlp.down_proj.weight.zero_()
    return m


@pytest.mark.vllm
def test_exported_drafter_serves_in_vllm_losslessly(tiny_target: Path, tmp_path: Path) -> None:
    """vLLM loads the exported drafter (method dflash, K = bs - 1); greedy output equals plain decoding and each
    verification step accepts as many tokens as the PyTorch drafter predicts."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
    max_tokens = 40
    target = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    ids = [tok(p)["input_ids"] for p in prompts]
    with torch.no_grad():
        plain = [target.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False) for p in ids]
    plain_out = [g[0, len(p) :].tolist() for g, p in zip(plain, ids, strict=True)]
    draft = copying_drafter(tiny_target)
    save_dflash(draft, tmp_path / "draft", tiny_target)
    expected = [reference_spec_decode(target, draft, p, max_tokens) for p in ids]
    assert len({a for _, acc in expected for a in acc} - {0}) >= 2  # the check below is not vacuous

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        llm = LLM(
            str(tiny_target),
            dtype="float32",
            max_model_len=512,
            enforce_eager=True,
            seed=0,
            speculative_config={
                "method": "dflash",
                "model": str(tmp_path / "draft"),
                "num_speculative_tokens": 7,
            },
            per_request_spec_decode_metrics="detailed",
        )
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    for out, plain_ids, (ref_ids, ref_accepted) in zip(outs, plain_out, expected, strict=True):
        got = out.outputs[0]
        assert list(got.token_ids) == plain_ids == ref_ids
        assert got.spec_decode_metrics is not None
        assert got.spec_decode_metrics.per_step_accepted == ref_accepted
