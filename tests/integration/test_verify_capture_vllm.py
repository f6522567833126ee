"""Verify-pass capture on the real vLLM CPU engine (V1 runner): it changes nothing vLLM does, its records are the
scheduler's, and its teacher is the replay's.

Target: the embedded SmolLM2-135M (float32). Draft: the target without its last layer (standalone kind), which
accepts about half of its proposals, so full accepts, rejections and bonus rows all occur.

- non-interference: two fresh engines, capture off (the scheduler subclass records) and on (the workers record):
  greedy, the same tokens, log-probs, vLLM spec-decode counters and records. At a seeded T = 0.8 vLLM's CPU
  speculative decoding is not reproducible even between two fresh engines without capture (measured: 3 of 3
  prompts differ from the third token on), so there the capture is held to vLLM's own counters (every step
  recorded, acceptances summing to vLLM's) and to the record invariants; that it hands vLLM's sampler the very
  tensors and draws no random numbers is tests/unit/test_verify_capture.py's;
- the records the workers capture equal the records of the scheduler subclass (the recording path that needs
  synchronous scheduling), step for step, and satisfy the record invariants;
- the captured teacher equals the replay's (`check_teacher.compare`, float32, 1e-4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from draft_opd_ray.rollout.engine import Sampling
from draft_opd_ray.wire import consistency_error
from tests.helpers import chat_prompt_ids, spec_engine

pytestmark = [pytest.mark.vllm]

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors."]
K = 4
SAMPLING = Sampling(max_new_tokens=40, stop_token_ids=(2,))


@pytest.fixture(scope="module")
def models(
    tmp_path_factory: pytest.TempPathFactory, embedded_target: Path
) -> tuple[Path, Path, list[list[int]]]:
    from draft_opd_ray.drafts.standalone.model import build_standalone_from_target

    draft = build_standalone_from_target(
        embedded_target, tmp_path_factory.mktemp("draft"), layer_ids=list(range(29))
    )
    return embedded_target, draft, chat_prompt_ids(embedded_target, QUESTIONS)


def _outputs(engine: Any, prompts: list[list[int]], temperature: float) -> list[tuple[Any, ...]]:
    """(token ids, log-probs of the sampled tokens, vLLM's spec-decode counters) per request, straight from vLLM."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(
        temperature=temperature,
        seed=7 if temperature > 0 else None,
        max_tokens=40,
        logprobs=0,
        detokenize=False,
    )
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        lps = [next(iter(d.values())).logprob for d in c.logprobs]
        rows.append((list(c.token_ids), lps, c.spec_decode_metrics.to_dict()))
    return rows


def _rounds(engine: Any, prompts: list[list[int]]) -> tuple[Any, Any, Any]:
    """A fresh engine's first three rounds: seeded T = 0.8 records, greedy outputs with log-probs, greedy records.
    (A sampled round is reproducible only from the same engine state: vLLM's draft sampling draws from the
    engine's generator, so the second T = 0.8 round of one engine differs from its first.)"""
    hot = engine.generate(prompts, Sampling(temperature=0.8, seed=7, max_new_tokens=40, stop_token_ids=(2,)))
    greedy = _outputs(engine, prompts, 0.0)
    return hot, greedy, engine.generate(prompts, SAMPLING)


def _same_records(a: Any, b: Any) -> None:
    assert a.response_ids == b.response_ids
    assert (a.anchor_pos, a.drafted, a.accepted) == (b.anchor_pos, b.drafted, b.accepted)
    assert (
        (a.vllm_steps, a.vllm_accepted) == (b.vllm_steps, b.vllm_accepted) == (a.num_steps, sum(a.accepted))
    )


def test_capture_changes_nothing_and_records_what_the_scheduler_records(models: Any) -> None:
    target, draft, prompts = models
    from draft_opd_ray.check_teacher import compare
    from draft_opd_ray.config.schema import DraftConfig, LossConfig, ReplayConfig, TeacherConfig
    from draft_opd_ray.opd.replay import ReplayActor, ReplayRun
    from draft_opd_ray.wire import ReplayItem

    # capture off: the scheduler subclass records; capture on: the workers record, and keep the teacher
    off_engine = spec_engine(target, "standalone", draft, K, max_model_len=1024, dtype="float32")
    try:
        off = _rounds(off_engine, prompts)
    finally:
        off_engine.shutdown()
    on_engine = spec_engine(
        target, "standalone", draft, K, max_model_len=1024, dtype="float32", capture_topk=8
    )
    try:
        on = _rounds(on_engine, prompts)
    finally:
        on_engine.shutdown()

    _, greedy_off, by_scheduler = off
    hot_on, greedy_on, captured = on
    assert greedy_on == greedy_off  # tokens, log-probs and vLLM's counters, exactly
    for a in hot_on:  # seeded T = 0.8: every step recorded, as vLLM counted them
        assert consistency_error(a) is None, consistency_error(a)
        assert (a.vllm_steps, a.vllm_accepted) == (a.num_steps, sum(a.accepted)) and a.captured is not None
    assert any(a.response_ids != b.response_ids for a, b in zip(hot_on, captured))  # T = 0.8 did sample
    steps = 0
    for a, b in zip(captured, by_scheduler):
        assert consistency_error(a) is None, consistency_error(a)
        _same_records(a, b)
        assert a.captured is not None and a.captured.topk_ids.shape == (a.num_steps, K + 1, 8)
        steps += a.num_steps
    for a in hot_on + captured:  # what a server has: the capture alone gives the prompt and committed tokens
        assert a.captured is not None
        got = a.captured.record(a.request_id, 0)
        assert got.prompt_ids == a.prompt_ids and got.response_ids == a.response_ids[: len(got.response_ids)]
        assert len(got.response_ids) == a.committed_by_steps() - 1 and consistency_error(got) is None
    accepted = [x for r in captured for x in r.accepted]
    assert 0 in accepted and K in accepted  # rejections and full accepts (bonus rows) both captured

    replay = ReplayActor(
        ReplayRun(str(target), [], None),
        DraftConfig(kind="standalone", num_speculative_tokens=K),
        TeacherConfig(dtype="float32", topk=None),
        LossConfig(estimator="full"),
        ReplayConfig(),
    )
    items = replay.score(
        [ReplayItem(r.prompt_ids + r.response_ids, r.anchor_pos, r.drafted, r.accepted, 0) for r in captured]
    )
    c = compare(captured, items, 1e-4)
    print(f"capture vs replay: {c}")
    assert c.steps == steps and c.positions > 0.9 * steps * 2
    assert c.ok(1e-4), c
