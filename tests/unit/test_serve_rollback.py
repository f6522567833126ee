"""Rolling a running server back to a version it published (`serve/rollback.py`, `Refitter.roll_back`): the request
file taken once, the refit of the version's folder proved against a stand-in engine, `latest` pointed at it, the
queue emptied and the learner restarted (or stopped with `freeze`); a version never published refused with no load;
and the command's answers: one `error:` line and exit 2 for a run dir that is not a server's or whose server does
not answer, the server's answer once its status lists the request (a stand-in status route that takes it)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from draft_opd_ray.config.schema import Config
from draft_opd_ray.metrics import MetricsLogger
from draft_opd_ray.serve import rollback
from draft_opd_ray.serve.server import Feed, Refitter, Status
from tests.helpers import RefitEngine, free_port


def test_a_request_is_taken_once_and_a_file_that_is_none_is_refused(tmp_path: Path) -> None:
    assert rollback.take_request(tmp_path) is None
    (tmp_path / rollback.REQUEST).write_text(json.dumps({"id": "a", "version": 1}))
    assert rollback.waiting(tmp_path)
    assert rollback.take_request(tmp_path) == {"id": "a", "version": 1}
    assert not rollback.waiting(tmp_path) and rollback.take_request(tmp_path) is None
    (tmp_path / rollback.REQUEST).write_text("[1, 2")
    got = rollback.take_request(tmp_path)
    assert got is not None and got["version"] is None and "not a rollback request" in got["error"]


class _Learner:
    def __init__(self) -> None:
        self.restarted: list[tuple[str, bool, Any]] = []

    def restart(self, folder: str, failed: bool = True, moments: Any = None) -> None:
        self.restarted.append((folder, failed, moments))


def _versions(run_dir: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """The draft the server started with (version 0) and published versions 1 and 2, `latest` naming 2."""
    from draft_opd_ray.checkpoint import point_latest

    g = torch.Generator().manual_seed(0)
    weights = {
        v: {"fc.weight": torch.randn(4, 6, generator=g), "norm.weight": torch.randn(4, generator=g)}
        for v in range(3)
    }
    first = run_dir / "start" / "draft"
    for v, w in weights.items():
        folder = first if v == 0 else run_dir / "checkpoints" / "serve" / f"v{v:04d}" / "draft"
        folder.mkdir(parents=True)
        save_file({**w, "d2t": torch.arange(3)}, str(folder / "model.safetensors"))
    point_latest(run_dir / "checkpoints" / "serve", "v0002")
    return first, weights


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Refitter, RefitEngine, dict[int, dict[str, torch.Tensor]]]]:
    first, weights = _versions(tmp_path)
    engine = RefitEngine(corrupt=set())
    status = Status(learning=True, version=2, published=[0, 1, 2])
    metrics = MetricsLogger(tmp_path, wandb_mode="disabled")
    refitter = Refitter(engine, Config(), status, tmp_path, metrics, str(first))
    refitter.keys = {"fc.weight", "norm.weight"}  # what the refits of versions 1 and 2 sent
    yield refitter, engine, weights
    metrics.close()


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_rollback_refits_the_version_proves_it_and_restarts_the_learner(served: Any) -> None:
    refitter, engine, weights = served
    feed, learner = Feed(refitter.cfg), _Learner()
    feed.pending.append("drafted by version 2")
    torch.save(
        {"version": 2, "ranks": [{"step": 2}]}, refitter.run_dir / "checkpoints" / "serve" / "optimizer.pt"
    )
    got = asyncio.run(refitter.roll_back(learner, feed, {"id": "r1", "version": 1}))
    assert got is learner and refitter.status.version == 1 and refitter.status.learning
    assert engine.loads == [1] and set(engine.held) == {"fc.weight", "norm.weight"}  # not the id map
    assert all(torch.equal(engine.held[k], weights[1][k]) for k in engine.held)
    root = refitter.run_dir / "checkpoints" / "serve"
    assert (root / "latest").resolve().name == "v0001" and feed.pending == []
    assert learner.restarted == [(str(root / "v0001" / "draft"), False, None)]  # optimizer.pt is version 2's
    (entry,) = refitter.status.as_dict()["rollbacks"]
    assert entry["id"] == "r1" and (entry["to"], entry["from"], entry["error"]) == (1, 2, None)
    (row,) = _rows(refitter.run_dir)
    assert row["decision"] == "rolled_back" and row["to"] == 1 and row["from"] == 2


def test_back_to_the_first_draft_with_freeze_stops_learning(served: Any) -> None:
    refitter, engine, weights = served
    got = asyncio.run(refitter.roll_back(_Learner(), Feed(refitter.cfg), {"version": 0, "freeze": True}))
    assert got is None and not refitter.status.learning and refitter.status.version == 0
    assert engine.loads == [0] and torch.equal(engine.held["fc.weight"], weights[0]["fc.weight"])
    assert not (refitter.run_dir / "checkpoints" / "serve" / "latest").exists()  # served_draft: the first one


def test_a_version_never_published_is_refused_and_nothing_loads(served: Any) -> None:
    refitter, engine, _ = served
    refitter.status.refused.append(3)
    learner = _Learner()
    got = asyncio.run(refitter.roll_back(learner, Feed(refitter.cfg), {"id": "r2", "version": 3}))
    assert got is learner and engine.loads == [] and refitter.status.version == 2 and learner.restarted == []
    (entry,) = refitter.status.rollbacks
    assert entry["error"] == "version 3 was never published by this server (published: [0, 1, 2])"
    (row,) = _rows(refitter.run_dir)
    assert row["decision"] == "rollback_failed" and row["step"] == 3


def test_a_rollback_whose_refit_fails_its_proof_stays_on_the_served_version(served: Any) -> None:
    refitter, engine, weights = served
    engine.corrupt = {1}
    asyncio.run(refitter.roll_back(_Learner(), Feed(refitter.cfg), {"version": 1}))
    assert engine.loads == [1, 2] and refitter.status.version == 2  # loaded back: version 2, proved
    assert torch.equal(engine.held["fc.weight"], weights[2]["fc.weight"])
    assert "rolled back to version 2, proved" in refitter.status.rollbacks[0]["error"]
    assert (refitter.run_dir / "checkpoints" / "serve" / "latest").resolve().name == "v0002"


def _run_dir(tmp_path: Path, port: int) -> Path:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(f"serve:\n  host: 0.0.0.0\n  port: {port}\n")
    return tmp_path


def test_the_command_refuses_a_dir_that_is_not_a_servers_and_a_server_that_is_gone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert rollback.main([str(tmp_path / "nowhere"), "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: RUN_DIR: ") and "not a server's run dir" in err[0]
    port = free_port()
    assert rollback.main([str(_run_dir(tmp_path, port)), "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"no server answers at http://127.0.0.1:{port}/draft/status" in err[0]
    assert not (tmp_path / rollback.REQUEST).exists()


@pytest.fixture
def status_route(tmp_path: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """An HTTP server with the status route alone (standing in for the server) that takes a waiting request at each
    GET, as the learning task does at each poll, and lists the answer."""
    status: dict[str, Any] = {"version": 2, "published": [0, 1, 2], "rollbacks": []}
    run_dir = _run_dir(tmp_path, free_port())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if (req := rollback.take_request(run_dir)) is not None:
                status["rollbacks"].append({"id": req["id"], "to": req["version"], "from": status["version"]})
                status["rollbacks"][-1].update(
                    error=None, refit_s=0.5, learner="the learner restarted from it"
                )
                status["version"] = req["version"]
            body = json.dumps(status).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    port = int(rollback.server_url(run_dir).rsplit(":", 1)[1])
    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield run_dir, status
    httpd.shutdown()
    httpd.server_close()


def test_the_command_waits_for_the_servers_answer(
    status_route: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, status = status_route
    assert rollback.main([str(run_dir), "5"]) == 2
    assert capsys.readouterr().err == (
        "error: VERSION: version 5 was never published by this server (published: [0, 1, 2])\n"
    )
    assert rollback.main([str(run_dir), "1", "--timeout", "30"]) == 0
    out = capsys.readouterr().out
    assert out == "version 1 serves again (was 2; refit 0.50 s, proved); the learner restarted from it\n"
    assert status["version"] == 1 and not (run_dir / rollback.REQUEST).exists()
    assert rollback.main([str(run_dir), "1"]) == 0
    assert "already serves version 1" in capsys.readouterr().out and len(status["rollbacks"]) == 1


def test_the_spec_decode_counters_count_each_step_under_the_version_that_drafted_it() -> None:
    """`serve/counters.py` against brute force: a request whose steps two versions drafted, then a decision."""
    from prometheus_client import CollectorRegistry, generate_latest

    from draft_opd_ray.serve.counters import VersionCounters
    from draft_opd_ray.wire import RequestRecord

    reg = CollectorRegistry()
    c = VersionCounters(reg)
    r = RequestRecord(request_id="a", prompt_ids=[1], response_ids=[2, 3, 4, 5, 6, 7])
    r.drafted, r.accepted, r.policy_version = [[9, 9, 9], [9, 9, 9], [9, 9]], [2, 0, 1], [0, 0, 1]
    c.add([r, r])
    c.decided("published", 1)

    def value(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(f"draft_opd_ray:{name}", labels)

    assert value("spec_decode_num_drafts_total", draft_version="0") == 4
    assert value("spec_decode_num_draft_tokens_total", draft_version="0") == 12
    assert value("spec_decode_num_accepted_tokens_total", draft_version="0") == 4
    assert value("spec_decode_num_drafts_total", draft_version="1") == 2
    assert value("spec_decode_num_draft_tokens_total", draft_version="1") == 4
    assert value("spec_decode_num_accepted_tokens_total", draft_version="1") == 2
    assert value("draft_decisions_total", decision="published") == 1 and value("draft_version") == 1
    assert (
        'draft_opd_ray:spec_decode_num_drafts_total{draft_version="1"} 2.0' in generate_latest(reg).decode()
    )


def test_the_moments_saved_with_a_version_are_given_back_for_that_version_only(tmp_path: Path) -> None:
    from draft_opd_ray.serve.learn import MOMENTS, moments

    assert moments(tmp_path, 1) is None
    torch.save({"version": 3, "ranks": [{"exp_avg": torch.ones(2)}]}, tmp_path / MOMENTS)
    got = moments(tmp_path, 3)
    assert got is not None and torch.equal(got["ranks"][0]["exp_avg"], torch.ones(2))
    assert moments(tmp_path, 1) is None  # rolled back past the version they belong to: they start over


def test_a_candidate_takes_the_transfer_and_a_rollback_the_file(served: Any) -> None:
    """With vLLM's NCCL transfer in place (`Refitter.transfer`), a candidate (the learner's weights) goes through
    it, and a rollback (a folder's weights) through the file; both are proved by the engine's read-back."""
    refitter, engine, weights = served

    class Transfer:  # stands in for `NcclRefit`: the broadcast lands in the engine as a load would
        def __init__(self) -> None:
            self.sent: list[int] = []

        async def load(self, w: dict[str, torch.Tensor], version: int) -> None:
            self.sent.append(version)
            engine.held, engine.version = dict(w), version

    refitter.transfer = Transfer()
    candidate = {k: v + 1.0 for k, v in weights[2].items()}
    refitter.status.version, refitter.status.published = 2, [0, 1, 2]
    assert asyncio.run(refitter.refit(candidate, 3)) >= 0
    assert refitter.transfer.sent == [3] and engine.loads == []  # no file
    refitter.status.version, refitter.status.published = 3, [0, 1, 2, 3]
    asyncio.run(refitter.roll_back(None, Feed(refitter.cfg), {"version": 1}))
    assert refitter.transfer.sent == [3] and engine.loads == [1] and refitter.status.version == 1
