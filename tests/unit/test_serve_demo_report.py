"""The serve demo's report (`serve/demo.analyse`, `render`, `plot`) from the files the servers and the load generator
write, against brute force: τ by window in the order requests finished, the versions that drafted each window, the
learning minus static difference paired by prompt, and latency split by whether a refit was in flight."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draft_opd_ray.serve import demo


def _arm(out: Path, arm: str, rows: list[dict[str, Any]], decisions: list[dict[str, Any]]) -> None:
    (out / arm).mkdir(parents=True)
    (out / arm / "traffic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / arm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in decisions))


def test_the_report_is_a_function_of_the_servers_files(tmp_path: Path) -> None:
    # 8 requests per arm, closed in reverse order of their prompt; learning accepts more in its second half
    def row(i: int, accepted: int, v0: int, v1: int) -> dict[str, Any]:
        out = {"closed_at": 100.0 - i, "prompt": f"p{i}", "steps": 10, "accepted": accepted}
        return {**out, "first_version": v0, "last_version": v1}

    learning = [row(i, 5 if i < 4 else 2, 1 if i < 4 else 0, 1) for i in range(8)]
    static = [row(i, 2, 0, 0) for i in range(8)]
    refit = {"stage": "serve", "step": 1, "decision": "published", "refit_at": 50.0, "refit_s": 2.0}
    _arm(tmp_path, "learning", learning, [refit])
    _arm(tmp_path, "static", static, [])
    calls = {
        "learning": [{"start": 45.0, "end": 51.0, "ok": True}, {"start": 60.0, "end": 64.0, "ok": True}],
        "static": [{"start": 0.0, "end": 3.0, "ok": True}, {"start": 0.0, "end": 1.0, "ok": False}],
    }
    report = demo.analyse(tmp_path, calls, 2, 600.0)
    a = report["arms"]["learning"]
    # window 1 = the 4 that closed first (prompts 7..4: 2 accepted of 10 steps), window 2 = prompts 3..0
    assert [round(w["tau"], 6) for w in a["tau_by_window"]] == [1.2, 1.5]
    assert a["versions_by_window"] == [[0, 1], [1, 1]] and a["published"] == [1] and a["refused"] == []
    assert report["arms"]["static"]["requests_failed"] == 1
    lat = a["latency_s"]
    assert (lat["refit_in_flight"]["n"], lat["refit_in_flight"]["p50"]) == (1, 6.0)
    assert (lat["no_refit"]["n"], lat["no_refit"]["p50"]) == (1, 4.0)
    first, last = report["learning_minus_static_first_window"], report["learning_minus_static_last_window"]
    assert first["n"] == last["n"] == 4
    assert abs(first["pooled"]) < 1e-12 and abs(last["pooled"] - 0.3) < 1e-9
    text = demo.render(report)
    assert "learning - static, first window" in text and "a tie" in text and "learning above static" in text
    assert demo.plot(report, tmp_path).is_file()
