"""Anchor records: what a speculative-decoding rollout saw, one record per request (docs/design.md, "Records" and "Run directory").

Positions are indices into the full token sequence `prompt_ids + response_ids`. Verification step i drafted
`drafted[i]` (K' <= K ids) after the committed token at `anchor_pos[i]`, and the target accepted the first
`accepted[i]` of them, committing `accepted[i] + 1` tokens (the accepted ones plus a correction or bonus
token). The first response token comes from prefill and belongs to no step, so for a request that ran to
completion

    len(response_ids) == 1 + sum(accepted[i] + 1)              (minus what the length cap or a stop cut off)
    anchor_pos[0] == len(prompt_ids),  anchor_pos[i+1] == anchor_pos[i] + accepted[i] + 1.

tau (acceptance length) counts tokens per verification step, bonus/correction included: 1 + mean(accepted),
which is how vLLM's spec-decode counters define it. Imports only numpy/pyarrow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class RequestRecord:
    prompt_ids: list[int]
    response_ids: list[int]
    anchor_pos: list[int] = field(default_factory=list)
    drafted: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    policy_version: list[int] = field(default_factory=list)
    # target log-prob of each drafted token given the drafted prefix; empty lists where unknown
    teacher_logprob_drafted: list[list[float]] = field(default_factory=list)
    request_id: str = ""
    finish_reason: str = ""  # "length" | "stop" | "abort" | "error" | ""
    error: str = ""  # why the request was not run (empty prompt, too long, ...)
    # vLLM's own per-request spec-decode counters for the same request (-1 when not from vLLM)
    vllm_steps: int = -1
    vllm_accepted: int = -1

    @property
    def num_steps(self) -> int:
        return len(self.accepted)

    def committed_by_steps(self) -> int:
        """Response tokens the steps account for, prefill token included."""
        return 1 + sum(a + 1 for a in self.accepted) if self.response_ids else 0


def consistency_error(rec: RequestRecord) -> str | None:
    """Why a record breaks the invariants in the module docstring, or None if it is consistent."""
    n = len(rec.accepted)
    if not (len(rec.anchor_pos) == len(rec.drafted) == len(rec.policy_version) == n):
        return (
            f"per-step lists differ in length: anchor_pos {len(rec.anchor_pos)}, drafted {len(rec.drafted)}, "
            f"accepted {n}, policy_version {len(rec.policy_version)}"
        )
    for i, (a, d) in enumerate(zip(rec.accepted, rec.drafted)):
        if not 0 <= a <= len(d):
            return f"step {i}: accepted {a} outside [0, {len(d)}]"
    pos = len(rec.prompt_ids)
    for i, (p, a) in enumerate(zip(rec.anchor_pos, rec.accepted)):
        if p != pos:
            return f"step {i}: anchor_pos {p}, expected {pos}"
        pos += a + 1
    full = rec.committed_by_steps()
    got = len(rec.response_ids)
    if got > full or (got < full and rec.finish_reason not in ("length", "stop")):
        return f"response has {got} tokens but the steps commit {full} (finish_reason {rec.finish_reason!r})"
    seq = rec.prompt_ids + rec.response_ids
    for i, (p, a, d) in enumerate(zip(rec.anchor_pos, rec.accepted, rec.drafted)):
        if seq[p + 1 : p + 1 + a] != d[:a][: max(0, len(seq) - p - 1)]:
            return f"step {i}: accepted drafted ids {d[:a]} differ from the committed tokens"
    return None


def tau(records: Sequence[RequestRecord]) -> float:
    """Acceptance length over a set of requests: 1 + (accepted drafted tokens) / (verification steps)."""
    steps = sum(r.num_steps for r in records)
    return 1.0 + sum(sum(r.accepted) for r in records) / steps if steps else float("nan")


def tau_vllm(records: Sequence[RequestRecord]) -> float:
    """The same quantity from vLLM's own per-request spec-decode counters."""
    steps = sum(max(r.vllm_steps, 0) for r in records)
    return 1.0 + sum(max(r.vllm_accepted, 0) for r in records) / steps if steps else float("nan")


def acceptance_per_position(records: Sequence[RequestRecord], k: int) -> list[float]:
    """P(position j of a drafted block is accepted), j = 1..k, over the steps that drafted >= j tokens."""
    hit, seen = np.zeros(k), np.zeros(k)
    for r in records:
        for a, d in zip(r.accepted, r.drafted):
            m = min(len(d), k)
            seen[:m] += 1
            hit[: min(a, m)] += 1
    return [float(h / s) if s else float("nan") for h, s in zip(hit, seen)]


# ---------------------------------------------------------------------------------------------- Parquet


def _schema():  # noqa: ANN202 - pyarrow imported lazily
    import pyarrow as pa

    ids = pa.list_(pa.int32())
    return pa.schema(
        [
            ("request_id", pa.string()),
            ("prompt_ids", ids),
            ("response_ids", ids),
            ("anchor_pos", ids),
            ("drafted", pa.list_(ids)),
            ("accepted", ids),
            ("policy_version", pa.list_(pa.int64())),
            ("teacher_logprob_drafted", pa.list_(pa.list_(pa.float32()))),
            ("finish_reason", pa.string()),
            ("error", pa.string()),
            ("vllm_steps", pa.int64()),
            ("vllm_accepted", pa.int64()),
        ]
    )


def write_parquet(records: Sequence[RequestRecord], path: str | Path) -> Path:
    """Write records atomically (temp file + rename): a reader never sees half a file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = _schema()
    cols = {name: [getattr(r, name) for r in records] for name in schema.names}
    table = pa.table(cols, schema=schema)
    tmp = path.with_suffix(path.suffix + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path


def read_parquet(path: str | Path) -> list[RequestRecord]:
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    names = set(_schema().names)
    return [RequestRecord(**{k: v for k, v in row.items() if k in names}) for row in rows]
