"""τ measured one way (`draft_opd_ray.eval.tau`) on hand-built records: failed requests left out, plain decoding
(no verification step) falls back to vLLM's counters."""

from __future__ import annotations

import math
import random

from draft_opd_ray.eval.tau import measure, tau_stats
from draft_opd_ray.rollout.records import tau, tau_vllm
from draft_opd_ray.wire import RequestRecord
from tests.helpers import synth


def _counted(rec: RequestRecord, steps: int, accepted: int) -> RequestRecord:
    rec.vllm_steps, rec.vllm_accepted = steps, accepted
    return rec


def test_tau_stats_leave_out_failed_requests() -> None:
    rng = random.Random(0)
    ok = [
        _counted(synth(rng, num_speculative_tokens=4, steps=5), 5, 9),
        _counted(synth(rng, num_speculative_tokens=4, steps=3), 3, 2),
    ]
    failed = _counted(RequestRecord([1, 2], [], error="empty prompt", finish_reason="error"), 7, 0)
    failed.accepted = [0] * 7  # even steps of a failed request would not count
    stats = tau_stats([ok[0], failed, ok[1]])
    assert stats["tau"] == tau(ok) == 1 + sum(sum(r.accepted) for r in ok) / 8
    assert stats["tau_vllm"] == tau_vllm(ok) == 1 + 11 / 8
    assert stats["tokens"] == sum(len(r.response_ids) for r in ok) and stats["requests"] == 2.0


def test_tau_falls_back_to_vllm_counters_without_verification_steps() -> None:
    plain = [_counted(RequestRecord([1], [5, 6, 7]), 4, 6), _counted(RequestRecord([2], [8]), 2, 1)]
    stats = tau_stats(plain)
    assert stats["tau"] == stats["tau_vllm"] == 1 + 7 / 6
    assert stats["tokens"] == 4.0 and stats["requests"] == 2.0
    nothing = tau_stats([RequestRecord([1], [5])])  # no steps and no counters: undefined, not a number
    assert math.isnan(nothing["tau"]) and math.isnan(nothing["tau_vllm"])
    assert tau_stats([])["requests"] == 0.0


def test_measure_keeps_the_successful_records() -> None:
    rng = random.Random(1)
    good = [_counted(synth(rng), 6, 4), _counted(synth(rng), 6, 8)]
    bad = RequestRecord([], [], error="empty prompt")

    class Engine:
        def generate(self, prompts, sampling):
            assert prompts == [[1], [], [2]] and sampling == "greedy"
            return [good[0], bad, good[1]]

    stats, recs = measure(Engine(), [[1], [], [2]], "greedy")
    assert recs == good and stats == tau_stats(good)
