"""A draft folder served by stock `vllm serve` (vLLM's own OpenAI-compatible server, started as a user starts it, with
the `--speculative-config` a run prints: `eval/summary.serve_command`), queried with the `openai` client over HTTP:
at temperature 0 the answers equal the target's plain greedy decoding, and vLLM's Prometheus counters show the draft
proposing and being accepted.

The draft is an EAGLE-3 head for the tiny target written by `save_eagle3`, the saver every SFT and Draft-OPD
checkpoint uses, with large random weights so that acceptance varies from step to step."""

from __future__ import annotations

import os
import shlex
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch

from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3
from draft_opd_ray.eval.summary import serve_command
from tests.helpers import free_port, prom_counter, randomize_, wait_healthy

pytestmark = [pytest.mark.vllm]

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
MAX_TOKENS, K = 24, 3


def test_stock_vllm_serve_answers_as_plain_decoding(tiny_target: Path, tmp_path: Path) -> None:
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    with torch.no_grad():
        plain = [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p) :].tolist()
            for p in ids
        ]
    counts = torch.zeros(hf.config.vocab_size)
    for out in plain:
        counts[out] += 1
    # a draft vocabulary of the few ids the target emits, so that some proposals are accepted and some not
    draft = init_eagle3(tiny_target, draft_vocab_size=int((counts > 0).sum()) + 1, token_counts=counts)
    randomize_(draft, 0.3, torch.Generator().manual_seed(4))
    folder = save_eagle3(draft, tmp_path / "draft", tiny_target)

    # the line a run prints, run as written, with the flags of a CPU box and a port of its own
    report = {
        "target": str(tiny_target),
        "speculative_config": {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K},
    }
    port = free_port()
    cmd = shlex.split(serve_command(report)) + [
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512"),
        *("--enforce-eager", "--seed", "0"),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=400)
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
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    drafted = prom_counter(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = prom_counter(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    print(f"served: {drafted:.0f} drafted tokens, {accepted:.0f} accepted")
    assert drafted > 0 and 0 < accepted < drafted  # the draft served, and not trivially
