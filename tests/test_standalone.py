"""Standalone drafts cut from the target (embedding, final norm, LM head, a few layers): logits equal the truncated
target, save/load round trip, vocabulary checks, the shared target-folder helpers, and (marked ``vllm``) serving the
draft with vLLM's ``draft_model`` method."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_opd_ray.errors import ModelError
from draft_opd_ray.models.standalone import (
    build_standalone_from_target,
    check_layer_ids,
    check_standalone_against_target,
    load_standalone,
    read_target_tensors,
    save_standalone,
)
from draft_opd_ray.models.target import ensure_embedded_target
from draft_opd_ray.models.tiny import build_tiny_target


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny matrices: OpenMP hand-offs cost more than the math on a 2-core box (and vLLM needs the other core)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_target(
        tmp_path_factory.mktemp("sa") / "target", tokenizer_from=ensure_embedded_target()
    )


def _truncated_target(target_path: Path, layer_ids: list[int]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch.float32).eval()
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in layer_ids)
    model.config.num_hidden_layers = len(layer_ids)
    return model


@pytest.mark.parametrize("layer_ids", [None, (1, 3)])
def test_draft_equals_truncated_target(tiny_target: Path, tmp_path: Path, layer_ids) -> None:
    out = build_standalone_from_target(tiny_target, tmp_path / "d", num_layers=2, layer_ids=layer_ids)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 49152
    assert (out / "tokenizer.json").read_bytes() == (tiny_target / "tokenizer.json").read_bytes()
    draft = load_standalone(out, tiny_target).eval()
    ref = _truncated_target(tiny_target, list(layer_ids or (0, 1)))
    ids = torch.randint(0, 49152, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(draft(ids).logits, ref(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip_identical_logits(tiny_target: Path, tmp_path: Path) -> None:
    draft = load_standalone(build_standalone_from_target(tiny_target, tmp_path / "d", num_layers=1))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # "trained"
    save_standalone(draft, tmp_path / "trained", tiny_target)
    loaded = load_standalone(tmp_path / "trained", tiny_target)
    ids = torch.randint(0, 49152, (1, 7))
    with torch.no_grad():
        assert torch.equal(draft(ids).logits, loaded(ids).logits)


def test_mismatched_drafts_are_rejected(tiny_target: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"\[4\] out of range \[0, 4\)"):
        build_standalone_from_target(tiny_target, tmp_path / "a", layer_ids=(0, 4))
    with pytest.raises(ModelError, match="fewer layers than the target"):
        build_standalone_from_target(tiny_target, tmp_path / "b", num_layers=4)
    out = build_standalone_from_target(tiny_target, tmp_path / "c", num_layers=1)
    cfg = json.loads((out / "config.json").read_text())
    cfg["vocab_size"] = 32000
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="vocab_size 32000, the target has 49152"):
        check_standalone_against_target(out, tiny_target)


def test_target_helpers(tiny_target: Path, tmp_path: Path) -> None:
    w = read_target_tensors(tiny_target, ["model.embed_tokens.weight", "lm_head.weight"])
    assert torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])  # tied target
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(tiny_target)).save_pretrained(str(sharded), max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    got = read_target_tensors(sharded, ["model.layers.3.mlp.down_proj.weight", "model.norm.weight"])
    assert got["model.norm.weight"].shape == (64,)
    with pytest.raises(ModelError, match="no tensor 'model.layers.9.mlp.down_proj.weight'"):
        read_target_tensors(sharded, ["model.layers.9.mlp.down_proj.weight"])
    assert check_layer_ids([0, 2], 3, "x", "y") == (0, 2)
    with pytest.raises(ModelError, match="at least one"):
        check_layer_ids([], 3, "x", "y")


# --------------------------------------------------------------------------------------------------
# vLLM CPU speculative decoding (slow)
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_spec_decode(target, draft, prompt: list[int], max_tokens: int, k: int):
    seq = prompt + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]
    accepted: list[int] = []
    while len(seq) - len(prompt) < max_tokens:
        block: list[int] = []
        for _ in range(k):
            block.append(int(draft(torch.tensor([seq + block])).logits[0, -1].argmax()))
        greedy = target(torch.tensor([seq + block])).logits[0, len(seq) - 1 :].argmax(-1).tolist()
        a = 0
        while a < k and block[a] == greedy[a]:
            a += 1
        accepted.append(a)
        seq += block[:a] + [greedy[a]]
    return seq[len(prompt) : len(prompt) + max_tokens], accepted


@pytest.mark.vllm
def test_draft_serves_in_vllm_losslessly(tiny_target: Path, tmp_path: Path) -> None:
    """vLLM's draft_model method serves the cut draft; output equals plain decoding and acceptance per
    verification step equals the PyTorch reference."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
    max_tokens, k = 24, 3
    draft_dir = build_standalone_from_target(tiny_target, tmp_path / "draft", layer_ids=(0, 1, 3))
    target = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    draft = load_standalone(draft_dir).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    ids = [tok(p)["input_ids"] for p in prompts]
    with torch.no_grad():
        plain = [target.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False) for p in ids]
    plain_out = [g[0, len(p) :].tolist() for g, p in zip(plain, ids, strict=True)]
    expected = [reference_spec_decode(target, draft, p, max_tokens, k) for p in ids]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        llm = LLM(
            str(tiny_target),
            dtype="float32",
            max_model_len=512,
            enforce_eager=True,
            seed=0,
            speculative_config={
                "method": "draft_model",
                "model": str(draft_dir),
                "num_speculative_tokens": k,
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
