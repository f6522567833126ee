"""The server's guard (`serve/guard.py`) and its held-back slice (`serve/server.Feed`): the decision against its
margin, the acceptance it counts (greedy blocks matched against the committed continuation, brute force), a
candidate equal to the serving draft scoring the same, and every `holdout_every`-th request held back."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from draft_opd_ray.config.schema import Config
from draft_opd_ray.serve.guard import GuardActor, _matched, decide
from draft_opd_ray.serve.server import Feed
from draft_opd_ray.wire import RequestRecord
from tests.helpers import RefitEngine, perturbed, randomize_


def _counts(taus: list[float], steps: int = 50) -> list[dict[str, float]]:
    return [{"steps": steps, "accepted": round((t - 1) * steps)} for t in taus]


def test_the_decision_reads_the_lower_end_of_the_paired_interval() -> None:
    serving = _counts([1.2, 1.4, 1.3, 1.5, 1.1, 1.3])
    same = decide(serving, serving, 0.02)
    assert same.publish and same.diff["pooled"] == 0.0 and "not worse than -0.02" in same.why
    worse = decide(_counts([1.0, 1.1, 1.0, 1.2, 1.0, 1.0]), serving, 0.02)
    assert not worse.publish and worse.diff["pooled_hi"] < 0 and "below -0.02" in worse.why
    better = _counts([1.5, 1.7, 1.6, 1.8, 1.4, 1.6])
    assert decide(better, serving, -0.1).publish  # a negative margin asks for a gain, and this one makes it
    assert not decide(serving, serving, -0.1).publish
    assert not decide([], [], 0.02).publish  # nothing held back: nothing to judge on


def test_matched_is_the_common_prefix_with_the_committed_tokens() -> None:
    r = RequestRecord([1, 2], [3, 4, 5, 6])
    seq = r.prompt_ids + r.response_ids
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, len(seq) - 1))
        block = [int(x) for x in rng.integers(3, 7, size=3)]
        want = 0
        for j, y in enumerate(block):  # brute force: the first j where the block leaves the sequence
            if n + 1 + j >= len(seq) or seq[n + 1 + j] != y:
                break
            want = j + 1
        assert _matched(r, n, block) == want


def test_a_candidate_equal_to_the_serving_draft_scores_the_same(tmp_path: Path, tiny_target: Path) -> None:
    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3

    counts = torch.zeros(49152)
    counts[3:67] = 1.0  # the draft's 64 ids: those the records use
    draft = init_eagle3(tiny_target, draft_vocab_size=64, token_counts=counts)
    randomize_(draft, 0.3, torch.Generator().manual_seed(1))
    folder = save_eagle3(draft, tmp_path / "draft", tiny_target)
    guard = GuardActor("eagle3", str(folder), str(tiny_target), 3)
    g = torch.Generator().manual_seed(2)
    records = [
        RequestRecord(
            torch.randint(3, 67, (6,), generator=g).tolist(),
            torch.randint(3, 67, (10,), generator=g).tolist(),
        )
        for _ in range(3)
    ]
    same = guard.serving.rollout_state()
    got = guard.score(records, same)
    assert got["candidate"] == got["serving"] and [c["steps"] for c in got["serving"]] == [9, 9, 9]
    other = perturbed(same, 5.0, seed=3)
    moved = guard.score(records, other)
    assert moved["serving"] == got["serving"]  # the serving copy is untouched by a candidate
    guard.publish()
    assert guard.score(records, other)["serving"] == moved["candidate"]  # published: the new reference
    assert all(math.isfinite(c["accepted"]) for c in moved["candidate"])


def test_every_nth_request_is_held_back_and_the_slice_keeps_the_latest() -> None:
    cfg = Config()
    cfg.serve.holdout_every, cfg.serve.guard_requests = 3, 2
    feed = Feed(cfg)
    recs = [RequestRecord([i], [i]) for i in range(1, 10)]
    feed.add(recs[:5])
    assert [r.prompt_ids[0] for r in feed.held] == [3] and not feed.ready(1)  # the slice is not full yet
    feed.add(recs[5:])
    assert [r.prompt_ids[0] for r in feed.held] == [6, 9] and feed.ready(6) and not feed.ready(7)
    assert [r.prompt_ids[0] for r in feed.batch()] == [1, 2, 4, 5, 7, 8] and feed.pending == []
    cfg.serve.guard = False
    open_feed = Feed(cfg)
    open_feed.add(recs)
    assert len(open_feed.pending) == 9 and open_feed.ready(9) and not open_feed.held


@pytest.mark.parametrize("bad", [{"guard_requests": 0}, {"holdout_every": 1}])
def test_guard_keys_are_checked(bad: dict[str, int]) -> None:
    from draft_opd_ray.config.schema import ServeConfig
    from draft_opd_ray.errors import ConfigError

    with pytest.raises(ConfigError, match="serve."):
        ServeConfig(**bad)  # type: ignore[arg-type]


def test_a_refit_that_fails_its_proof_is_rolled_back_and_proved(tmp_path: Path) -> None:
    import asyncio

    from safetensors.torch import save_file

    from draft_opd_ray.serve.server import RefitRolledBack, Refitter, Status

    g = torch.Generator().manual_seed(0)
    served = {"fc.weight": torch.randn(4, 6, generator=g), "norm.weight": torch.randn(4, generator=g)}
    folder = tmp_path / "draft"
    folder.mkdir()
    save_file(served, str(folder / "model.safetensors"))
    cfg = Config()
    status = Status(learning=True)
    candidate = {k: v + 1.0 for k, v in served.items()}

    good = RefitEngine(corrupt=set())
    assert asyncio.run(Refitter(good, cfg, status, tmp_path, None, str(folder)).refit(candidate, 1)) >= 0
    assert good.loads == [1] and torch.equal(good.held["fc.weight"], candidate["fc.weight"])

    bad = RefitEngine(corrupt={1})  # version 1 reads back wrong: the served version 0 is loaded back
    with pytest.raises(RefitRolledBack, match="rolled back to version 0, proved"):
        asyncio.run(Refitter(bad, cfg, status, tmp_path, None, str(folder)).refit(candidate, 1))
    assert bad.loads == [1, 0] and bad.version == 0
    assert all(torch.equal(bad.held[k], served[k]) for k in served)  # the engine serves what it served before
