"""Anchor records on disk and their statistics: τ, per-position acceptance, Parquet I/O (docs/design.md, "Records"
and "Run directory"). The record itself, `RequestRecord`, and its invariants are a wire contract (`wire.py`).

tau (acceptance length) counts tokens per verification step, bonus/correction included: 1 + mean(accepted),
which is how vLLM's spec-decode counters define it. Imports only numpy/pyarrow and `wire`.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from draft_opd_ray.wire import CapturedSteps, RequestRecord, tensor_bytes, tensor_from_bytes


def tau(records: Sequence[RequestRecord]) -> float:
    """Acceptance length over a set of requests: 1 + (accepted drafted tokens) / (verification steps)."""
    steps = sum(r.num_steps for r in records)
    return 1.0 + sum(sum(r.accepted) for r in records) / steps if steps else float("nan")


def tau_vllm(records: Sequence[RequestRecord]) -> float:
    """The same quantity from vLLM's own per-request spec-decode counters."""
    steps = sum(max(r.vllm_steps, 0) for r in records)
    return 1.0 + sum(max(r.vllm_accepted, 0) for r in records) / steps if steps else float("nan")


def acceptance_per_position(records: Sequence[RequestRecord], num_speculative_tokens: int) -> list[float]:
    """P(position j of a drafted block is accepted), j = 1..``num_speculative_tokens``, over the steps that
    drafted >= j tokens."""
    hit, seen = np.zeros(num_speculative_tokens), np.zeros(num_speculative_tokens)
    for r in records:
        for a, d in zip(r.accepted, r.drafted):
            m = min(len(d), num_speculative_tokens)
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


def write_parquet(records: Sequence[RequestRecord], path: str | Path, *, captured: bool = False) -> Path:
    """Write records atomically (temp file + rename): a reader never sees half a file. ``captured``: keep the
    verification pass's teacher too (`RequestRecord.captured`, one binary cell per record; the rounds a checkpoint
    holds in flight, not the per-step anchor files, where it would add ~660 bytes per step)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = _schema()
    cols: dict[str, list[object]] = {name: [getattr(r, name) for r in records] for name in schema.names}
    if captured:
        schema = schema.append(pa.field("captured", pa.binary()))
        cols["captured"] = [_pack(r.captured) for r in records]
    table = pa.table(cols, schema=schema)
    tmp = path.with_suffix(path.suffix + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path


def read_parquet(path: str | Path) -> list[RequestRecord]:
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    names = set(_schema().names)
    out = []
    for row in rows:
        rec = RequestRecord(**{k: v for k, v in row.items() if k in names})
        rec.captured = _unpack(row.get("captured"))
        out.append(rec)
    return out


def _pack(steps: CapturedSteps | None) -> bytes | None:
    if steps is None:
        return None
    arrays: dict[str, np.ndarray] = {
        "anchor_pos": np.asarray(steps.anchor_pos, dtype=np.int64),
        "accepted": np.asarray(steps.accepted, dtype=np.int64),
        "drafted_len": np.asarray([len(d) for d in steps.drafted], dtype=np.int64),
        "drafted": np.asarray([t for d in steps.drafted for t in d], dtype=np.int64),
        "topk_ids": steps.topk_ids,
        "topk_logprobs": steps.topk_logprobs,
        "log_tail": steps.log_tail,
        "grammar": np.asarray(steps.grammar),
    }
    if (
        steps.features is not None and steps.feature_seen is not None
    ):  # raw bytes: bfloat16 has no numpy dtype
        arrays["features"] = np.frombuffer(tensor_bytes(steps.features), dtype=np.uint8)
        arrays["feature_shape"] = np.asarray(steps.features.shape, dtype=np.int64)
        arrays["feature_dtype"] = np.asarray(str(steps.features.dtype).removeprefix("torch."))
        arrays["feature_seen"] = steps.feature_seen
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def _unpack(data: bytes | None) -> CapturedSteps | None:
    if data is None:
        return None
    z = np.load(io.BytesIO(data))
    features = None
    if "features" in z:
        features = tensor_from_bytes(
            z["features"].tobytes(), str(z["feature_dtype"]), z["feature_shape"].tolist()
        )
    flat, lens = z["drafted"].tolist(), z["drafted_len"].tolist()
    starts = np.cumsum([0, *lens]).tolist()
    return CapturedSteps(
        z["anchor_pos"].tolist(),
        [flat[a:b] for a, b in zip(starts, starts[1:])],
        z["accepted"].tolist(),
        z["topk_ids"],
        z["topk_logprobs"],
        z["log_tail"],
        bool(z["grammar"]),
        features,
        z.get("feature_seen"),
    )
