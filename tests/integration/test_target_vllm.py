"""The embedded SmolLM2 target and the tiny random target on the real vLLM CPU engine (about 25-50 s to start an
engine on 2 cores): sensible greedy chat answers, deterministic token ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import vllm_llm

pytestmark = pytest.mark.vllm


class TestEmbeddedTargetOnVLLM:
    """One engine for the class, shut down before the next engine starts."""

    PROMPTS = ("What is the capital of France?", "What is 2+2?", "Name three colors.")

    @pytest.fixture(scope="class")
    def answers(self, embedded_target: Path) -> dict[str, str]:
        with vllm_llm(embedded_target, max_model_len=1024) as llm:
            from vllm import SamplingParams

            params = SamplingParams(temperature=0.0, max_tokens=48)
            outs = llm.chat([[{"role": "user", "content": p}] for p in self.PROMPTS], params, use_tqdm=False)
            return {p: o.outputs[0].text for p, o in zip(self.PROMPTS, outs, strict=True)}

    def test_capital_of_france(self, answers: dict[str, str]) -> None:
        assert "paris" in answers["What is the capital of France?"].lower()

    def test_two_plus_two(self, answers: dict[str, str]) -> None:
        assert "4" in answers["What is 2+2?"]

    def test_three_colors(self, answers: dict[str, str]) -> None:
        text = answers["Name three colors."].lower()
        colors = ("red", "blue", "green", "yellow", "orange", "purple", "black", "white", "pink", "brown")
        assert sum(c in text for c in colors) >= 2, text

    def test_answers_are_readable_text(self, answers: dict[str, str]) -> None:
        for prompt, text in answers.items():
            assert text.strip(), prompt
            ascii_share = sum(ch.isascii() for ch in text) / len(text)
            words = [w for w in text.split() if any(ch.isalpha() for ch in w)]
            assert ascii_share > 0.9 and len(words) >= 2, (prompt, text)
            assert "<|im_" not in text, (prompt, text)


def test_tiny_target_generates_deterministically_on_vllm(tiny_target: Path) -> None:
    with vllm_llm(tiny_target, max_model_len=1024) as llm:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        prompts = ["Hello, my name is", "The capital of France is"]
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(ids) == 16 for ids in first)
    assert all(0 <= i < 49152 for ids in first for i in ids)
    assert [list(x) for x in first] == [list(x) for x in second]
