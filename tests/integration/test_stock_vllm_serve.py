"""A draft folder served by stock `vllm serve` (vLLM's own OpenAI-compatible server, started as a user starts it, with
the `--speculative-config` a run prints: `eval/summary.serve_command`), queried with the `openai` client over HTTP:
at temperature 0 the answers equal the target's plain greedy decoding, and vLLM's Prometheus counters show the draft
proposing and being accepted.

The draft is an EAGLE-3 head for the tiny target written by `save_eagle3`, the saver every SFT and Draft-OPD
checkpoint uses, with large random weights so that acceptance varies from step to step."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from tests.helpers import greedy_and_head, prom_counter, stock_vllm_server

# slow tier: the same stock server on a draft trained by the server runs in test_serve_learns.py (slow too); the
# default tier's exported drafts are served by vLLM in test_serve_vllm.py
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
MAX_TOKENS, K = 24, 3


def test_stock_vllm_serve_answers_as_plain_decoding(tiny_target: Path, tmp_path: Path) -> None:
    from openai import OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    ids, plain, folder = greedy_and_head(tiny_target, PROMPTS, MAX_TOKENS, tmp_path / "draft")
    with stock_vllm_server(tiny_target, folder, K, tmp_path / "server.log") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        for p, want in zip(ids, plain, strict=True):
            out = client.completions.create(
                model=str(tiny_target),
                prompt=p,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            choice = out.choices[0]
            assert choice.text == tok.decode(want)
            got = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
            if got is not None:
                assert list(got) == want
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            metrics = r.read().decode()
    drafted = prom_counter(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = prom_counter(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    print(f"served: {drafted:.0f} drafted tokens, {accepted:.0f} accepted")
    assert drafted > 0 and 0 < accepted < drafted  # the draft served, and not trivially
