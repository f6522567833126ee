"""Exported drafts of every kind served by vLLM's CPU speculative decoding on the tiny target: greedy output equals
plain decoding, and every verification step accepts as many tokens as the PyTorch draft predicts (the reference
loop `tests.helpers.greedy_spec_decode`, drafting with this project's own modules)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from draft_opd_ray.drafts.dflash.model import DFlashDraft, init_dflash, save_dflash
from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3
from draft_opd_ray.drafts.standalone.model import build_standalone_from_target, load_standalone
from tests.helpers import greedy_spec_decode, randomize_, target_features, vllm_llm

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]


@dataclass
class Plain:
    """The HF target, the prompts' token ids and its plain greedy continuations."""

    target: Any
    ids: list[list[int]]
    out: list[list[int]]


def plain_greedy(target_dir: Path, max_tokens: int) -> Plain:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    with torch.no_grad():
        plain = [target.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False) for p in ids]
    return Plain(target, ids, [g[0, len(p) :].tolist() for g, p in zip(plain, ids, strict=True)])


def assert_serves_losslessly(
    target_dir: Path,
    method: str,
    draft_dir: Path,
    num_speculative_tokens: int,
    max_tokens: int,
    plain: Plain,
    expected: list,
) -> None:
    """vLLM with ``speculative_config`` (method, draft folder, num_speculative_tokens): token ids equal the plain greedy output
    and the reference's, and per-step acceptance equals the reference's ``expected`` (ids, accepted) pairs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    spec = {"method": method, "model": str(draft_dir), "num_speculative_tokens": num_speculative_tokens}
    with vllm_llm(
        target_dir, max_model_len=512, speculative_config=spec, per_request_spec_decode_metrics="detailed"
    ) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in plain.ids], params, use_tqdm=False)
    for out, plain_ids, (ref_ids, ref_accepted) in zip(outs, plain.out, expected, strict=True):
        got = out.outputs[0]
        assert list(got.token_ids) == plain_ids == ref_ids
        assert got.spec_decode_metrics is not None
        assert got.spec_decode_metrics.per_step_accepted == ref_accepted


def test_exported_eagle3_head_serves_in_vllm_losslessly(tiny_target: Path, tmp_path: Path) -> None:
    """A draft vocabulary of the few ids the target emits makes acceptance sensitive to any difference in the
    computation: features, positions, TTT attention, vocabulary map."""
    max_tokens, num_speculative_tokens = 24, 3
    plain = plain_greedy(tiny_target, max_tokens)
    counts = torch.zeros(49152)
    for out in plain.out:
        counts[out] += 1
    vocab = int((counts > 0).sum()) + 1  # the target's output tokens and eos
    draft = init_eagle3(tiny_target, draft_vocab_size=vocab, token_counts=counts)
    # large random weights: choices among the few ids change from step to step
    randomize_(draft, 0.3, torch.Generator().manual_seed(4))
    save_eagle3(draft, tmp_path / "draft", tiny_target)

    def propose(seq: list[int]) -> list[int]:
        feats = target_features(plain.target, seq, draft.hidden_state_indices)
        return draft.propose(torch.tensor([seq]), feats, torch.tensor([len(seq)]), num_speculative_tokens)[0][
            0
        ].tolist()

    expected = [
        greedy_spec_decode(plain.target, propose, p, max_tokens, num_speculative_tokens) for p in plain.ids
    ]
    assert len({a for _, acc in expected for a in acc} - {0}) >= 2  # the check below is not vacuous
    assert_serves_losslessly(
        tiny_target, "eagle3", tmp_path / "draft", num_speculative_tokens, max_tokens, plain, expected
    )


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


def test_exported_dflash_drafter_serves_in_vllm_losslessly(tiny_target: Path, tmp_path: Path) -> None:
    """Method dflash, K = block_size - 1 = 7."""
    max_tokens = 40
    plain = plain_greedy(tiny_target, max_tokens)
    draft = copying_drafter(tiny_target)
    save_dflash(draft, tmp_path / "draft", tiny_target)
    num_speculative_tokens = draft.config.block_size - 1

    def propose(seq: list[int]) -> list[int]:
        feats = target_features(plain.target, seq, draft.hidden_state_indices)
        return draft.propose(torch.tensor([seq]), feats, torch.tensor([len(seq)]))[0][0].tolist()

    expected = [
        greedy_spec_decode(plain.target, propose, p, max_tokens, num_speculative_tokens) for p in plain.ids
    ]
    assert len({a for _, acc in expected for a in acc} - {0}) >= 2  # the check below is not vacuous
    assert_serves_losslessly(
        tiny_target, "dflash", tmp_path / "draft", num_speculative_tokens, max_tokens, plain, expected
    )


def test_standalone_draft_serves_in_vllm_losslessly(tiny_target: Path, tmp_path: Path) -> None:
    """vLLM's draft_model method serves a draft cut from the target (layers 0, 1, 3)."""
    max_tokens, num_speculative_tokens = 24, 3
    draft_dir = build_standalone_from_target(tiny_target, tmp_path / "draft", layer_ids=(0, 1, 3))
    plain = plain_greedy(tiny_target, max_tokens)
    draft = load_standalone(draft_dir).eval()

    def propose(seq: list[int]) -> list[int]:
        block: list[int] = []
        for _ in range(num_speculative_tokens):
            block.append(int(draft(torch.tensor([seq + block])).logits[0, -1].argmax()))
        return block

    expected = [
        greedy_spec_decode(plain.target, propose, p, max_tokens, num_speculative_tokens) for p in plain.ids
    ]
    assert_serves_losslessly(
        tiny_target, "draft_model", draft_dir, num_speculative_tokens, max_tokens, plain, expected
    )
