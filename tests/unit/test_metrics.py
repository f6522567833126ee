"""metrics.jsonl is strict JSON (NaN and infinities written as null), a torn last line is skipped by its readers,
and any other bad line is named; reports are replaced atomically."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from draft_opd_ray.checkpoint import write_text_atomic
from draft_opd_ray.errors import DataError
from draft_opd_ray.metrics import MetricsLogger, json_line, read_metrics


def _strict(line: str) -> dict:
    def refuse(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_values_are_written_as_null(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, wandb_mode="disabled")
    log.log("opd", 1, loss=float("nan"), grad=float("inf"), per_pos=[1.0, -math.inf], ok=0.5)
    line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    row = _strict(line)
    assert row["loss"] is None and row["grad"] is None and row["per_pos"] == [1.0, None] and row["ok"] == 0.5
    assert _strict(json_line({"x": {"y": float("nan")}})) == {"x": {"y": None}}


def test_a_torn_last_line_is_skipped_and_any_other_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    good = json_line({"stage": "opd", "step": 1}) + json_line({"stage": "opd", "step": 2})
    path.write_text(good + '{"stage": "opd", "st')  # killed mid-write
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text(good + "garbage\n" + json_line({"stage": "opd", "step": 3}))
    with pytest.raises(DataError, match=r"metrics.jsonl: line 3 is not JSON"):
        read_metrics(path)


def test_a_report_is_replaced_whole(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    write_text_atomic(out, "one\n")
    write_text_atomic(out, "two\n")
    assert out.read_text() == "two\n" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
