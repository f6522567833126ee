"""Anchor selection (docs/design.md, "Anchors"): which verification steps of the rollouts are replayed.

- `error`  (default): block starts whose block was not fully accepted (accepted < drafted).
- `all`:    every block start.
- `random`: uniformly random response positions, as many per sequence as `error` would pick there
            (budget-matched ablation). A random position has no recorded block: replay must redraft it.
Caps (both off by default): at most `max_per_sequence` per request (a seeded uniform sample), then whole
requests, in a seeded random order, while their anchors fit in `max_per_step`. The replay pays one forward over
a request's whole sequence whatever number of its anchors are kept, so the step cap never splits a request: an
anchor is dropped only with its sequence, before that forward is paid. Returned in (request, position) order.
Imports only the standard library.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from draft_opd_ray.wire import RequestRecord


@dataclass(frozen=True)
class Anchor:
    request: int  # index into the records passed to select_anchors
    pos: int  # index in prompt + response of the last committed token before the block
    step: int  # verification step it came from; -1 for a random position
    drafted: tuple[int, ...]  # the recorded block (empty for random anchors: redraft)
    accepted: int  # recorded acceptance; -1 when unknown
    policy_version: int  # version of the draft that proposed the block; -1 when unknown


def _error_steps(rec: RequestRecord) -> list[int]:
    return [i for i, (a, d) in enumerate(zip(rec.accepted, rec.drafted)) if a < len(d)]


def _from_step(req: int, rec: RequestRecord, i: int) -> Anchor:
    return Anchor(req, rec.anchor_pos[i], i, tuple(rec.drafted[i]), rec.accepted[i], rec.policy_version[i])


def _sample(items: list[Anchor], n: int | None, rng: random.Random) -> list[Anchor]:
    return items if n is None or len(items) <= n else rng.sample(items, n)


def _whole_requests(per_request: list[list[Anchor]], budget: int | None, rng: random.Random) -> list[Anchor]:
    """Every request's anchors, or, over ``budget``, whole requests in a seeded order while they fit."""
    if budget is None or sum(map(len, per_request)) <= budget:
        return [a for group in per_request for a in group]
    order = list(range(len(per_request)))
    rng.shuffle(order)
    kept: list[Anchor] = []
    for i in order:
        if len(kept) + len(per_request[i]) <= budget:
            kept += per_request[i]
    return kept


def select_anchors(
    records: Sequence[RequestRecord],
    *,
    policy: str,
    max_per_sequence: int | None = None,
    max_per_step: int | None = None,
    seed: int = 0,
) -> list[Anchor]:
    rng = random.Random(seed)
    per_request: list[list[Anchor]] = []
    for req, rec in enumerate(records):
        if policy == "all":
            cands = [_from_step(req, rec, i) for i in range(rec.num_steps)]
        elif policy == "error":
            cands = [_from_step(req, rec, i) for i in _error_steps(rec)]
        elif policy == "random":
            n = len(_error_steps(rec))
            n = n if max_per_sequence is None else min(n, max_per_sequence)
            first, last = len(rec.prompt_ids), len(rec.prompt_ids) + len(rec.response_ids) - 2
            positions = list(range(first, last + 1))  # a position needs at least one token after it
            cands = [Anchor(req, p, -1, (), -1, -1) for p in rng.sample(positions, min(n, len(positions)))]
        else:
            raise ValueError(f"anchor.policy: unknown policy {policy!r}")
        per_request.append(_sample(cands, max_per_sequence, rng))
    chosen = _whole_requests(per_request, max_per_step, rng)
    return sorted(chosen, key=lambda a: (a.request, a.pos))
