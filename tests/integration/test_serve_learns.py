"""`python -m draft_opd_ray.serve` as a user starts it, queried over HTTP with the `openai` client while its draft
learns from that traffic: vLLM's own OpenAI server on the tiny target and an EAGLE-3 head, the verify-pass capture
installed through the worker extension, a replay actor and a DeepSpeed learner on local Ray, every new version
refit into the running engine and proved.

One server serves every test of this module (its start-up is most of the cost):
- at temperature 0 every answer equals the target's plain greedy decoding, before, during and after two refits;
- `GET /draft/status` reports the versions published and τ by version, and vLLM's `/metrics` still answers;
- `python -m draft_opd_ray.serve.rollback` makes it serve version 1 again, proved, the answers still the target's;
- a malformed request gets vLLM's own 4xx, and the server and its learner go on;
- Ctrl-C (SIGINT) stops it: exit 130, one `interrupted:` line naming the draft it served last, no process left;
- that trained draft, served by stock vLLM (`vllm serve` as the run's closing screen prints it), answers as plain
  decoding too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import helpers

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray, pytest.mark.deepspeed]

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time"]
MAX_TOKENS, K, PER_UPDATE, VERSIONS = 24, 3, 4, 2


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    return json.loads(body) if url.endswith("status") else body


def _wait(url: str, proc: subprocess.Popen[str], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            _get(f"{url}/draft/status")
            return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"serve not up after {timeout} s:\n{log.read_text()[-3000:]}")


class Server:
    def __init__(
        self, proc: subprocess.Popen[str], url: str, log: Path, run_dir: Path, plain: list[list[int]]
    ):
        self.proc, self.url, self.log, self.run_dir, self.plain = proc, url, log, run_dir, plain
        self.ids: list[list[int]] = []


@pytest.fixture(scope="module")
def models(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The prompts' plain greedy answers and an EAGLE-3 head for the tiny target."""
    ids, plain, folder = helpers.greedy_and_head(
        tiny_target, PROMPTS, MAX_TOKENS, tmp_path_factory.mktemp("models") / "draft"
    )
    return {"ids": ids, "plain": plain, "draft": folder}


def _start(target: Path, models: dict[str, Any], tmp: Path, *extra: str) -> Iterator[Server]:
    """The server on the tiny target and the head, a version every `PER_UPDATE` requests, the guard judging each on
    the last 2 of every 3rd request; ``extra`` overrides follow."""
    folder = models["draft"]
    conf = json.loads((folder / "config.json").read_text())
    aux = conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    port = helpers.free_port()
    run_dir = tmp / "run"
    log = tmp / "serve.log"
    overrides = [
        f"target.path={target}",
        "target.dtype=float32",
        "target.max_model_len=1024",
        f"draft.path={folder}",
        f"draft.aux_layer_ids=[{','.join(map(str, aux))}]",
        f"draft.num_speculative_tokens={K}",
        f"draft.draft_vocab_size={conf['draft_vocab_size']}",
        f"serve.port={port}",
        f"serve.requests_per_update={PER_UPDATE}",
        f"serve.max_versions={VERSIONS}",
        "serve.poll_s=1.0",
        "serve.guard_requests=2",
        "serve.holdout_every=3",
        "learner.mini_batches=1",
        "teacher.topk=4",  # within the draft's few-token vocabulary
        "rollout.kvcache_gb=1",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "draft_opd_ray.serve", *overrides],
            cwd=helpers.REPO,
            env={**os.environ, "PYTHONPATH": str(helpers.REPO)},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: the test can tell whether anything is left
        )
    url = f"http://127.0.0.1:{port}"
    s = Server(proc, url, log, run_dir, models["plain"])
    s.ids = models["ids"]
    try:
        _wait(url, proc, log, timeout=600)
        yield s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(
    tiny_target: Path, models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A lenient guard (a candidate may lose up to 1.0 of τ): every candidate is judged and published."""
    yield from _start(tiny_target, models, tmp_path_factory.mktemp("serve"), "serve.guard_margin=1.0")


@pytest.fixture  # one test's: stopped when it ends (two CPU engines at once would share core 0)
def refusing(
    tiny_target: Path, models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A guard that asks for a gain of 1.0 in τ, which no candidate of a few learning-rate-1e-5 updates makes."""
    yield from _start(
        tiny_target,
        models,
        tmp_path_factory.mktemp("refusing"),
        "serve.guard_margin=-1.0",
        "serve.max_versions=1",
    )


def _ask(client: Any, model: str, ids: list[int]) -> list[int]:
    out = client.completions.create(
        model=model,
        prompt=ids,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = out.choices[0]
    return list(getattr(choice, "token_ids", None) or (choice.model_extra or {})["token_ids"])


def test_answers_equal_plain_decoding_across_two_refits(server: Server, tiny_target: Path) -> None:
    rounds = [0]

    def done(status: dict[str, Any]) -> bool:  # two versions published, and a round served after the last
        rounds[0] += 1 if status["version"] >= VERSIONS else 0
        return rounds[0] >= 2

    _traffic_until(server, tiny_target, done)
    status = _get(f"{server.url}/draft/status")
    print(f"status: {status}")
    assert status["published"] == list(range(VERSIONS + 1)) and status["refused"] == []
    assert status["requests"] >= VERSIONS * PER_UPDATE and not status["learning"]
    assert set(status["tau_by_version"]) >= {"0", "1"}
    assert all(1.0 <= t <= K + 1 for t in status["tau_by_version"].values())
    rows = [json.loads(x) for x in (server.run_dir / "metrics.jsonl").read_text().splitlines()]
    published = [r for r in rows if r.get("stage") == "serve" and r.get("decision") == "published"]
    assert [r["step"] for r in published] == list(range(1, VERSIONS + 1))
    assert all("not worse than -1" in r["why"] and r["guard_n"] == 2 for r in published)  # each one judged
    assert (server.run_dir / "checkpoints" / "serve" / "latest" / "draft" / "config.json").is_file()
    traffic = [json.loads(x) for x in (server.run_dir / "traffic.jsonl").read_text().splitlines()]
    assert len(traffic) == status["requests"] and all(t["steps"] > 0 for t in traffic)
    assert 0 < sum(t["accepted"] for t in traffic) < sum(t["steps"] * K for t in traffic)  # accepted, not all
    metrics = _get(f"{server.url}/metrics")
    assert "vllm:spec_decode_num_draft_tokens_total" in metrics
    # the same counts by draft version (`serve/counters.py`), from the requests closed so far
    drafts = helpers.prom_counter(metrics, "draft_opd_ray:spec_decode_num_drafts_total")
    assert drafts >= sum(t["steps"] for t in traffic) > 0
    for v in ("0", "1"):
        assert f'draft_opd_ray:spec_decode_num_drafts_total{{draft_version="{v}"}}' in metrics
    assert f"draft_opd_ray:draft_version {float(VERSIONS)}" in metrics
    assert helpers.prom_counter(metrics, "draft_opd_ray:draft_decisions_total") == VERSIONS


def _rollback(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "draft_opd_ray.serve.rollback", str(server.run_dir), *args],
        cwd=helpers.REPO,
        env={**os.environ, "PYTHONPATH": str(helpers.REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_rollback_serves_an_earlier_version_and_answers_stay_the_targets(
    server: Server, tiny_target: Path
) -> None:
    """After the two refits: `python -m draft_opd_ray.serve.rollback RUN_DIR 1` while the server runs; version 1
    serves again (refit and proved), `latest` names it, and the answers are still plain decoding's. A version the
    server never published is one `error:` line, exit 2, and changes nothing."""
    assert _get(f"{server.url}/draft/status")["version"] == VERSIONS, "runs after the two refits"
    out = _rollback(server, "1")
    assert out.returncode == 0, out.stderr + server.log.read_text()[-3000:]
    assert out.stdout.startswith(f"version 1 serves again (was {VERSIONS}; refit "), out.stdout
    status = _traffic_until(server, tiny_target, lambda s: True)  # a round drafted by version 1
    (entry,) = status["rollbacks"]
    assert (
        status["version"] == 1 and entry["to"] == 1 and entry["from"] == VERSIONS and entry["error"] is None
    )
    assert status["tau_by_version"]["1"] >= 1.0
    latest = (server.run_dir / "checkpoints" / "serve" / "latest").resolve()
    assert latest.name == "v0001" and not (server.run_dir / "rollback.json").exists()
    rows = [json.loads(x) for x in (server.run_dir / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r.get("decision") == "rolled_back"]
    assert row["to"] == 1 and row["from"] == VERSIONS and row["refit_s"] > 0
    bad = _rollback(server, "7")
    assert bad.returncode == 2 and bad.stdout == "", bad
    assert bad.stderr.splitlines() == [
        f"error: VERSION: version 7 was never published by this server (published: {list(range(VERSIONS + 1))})"
    ]
    same = _rollback(server, "1")
    assert same.returncode == 0 and "already serves version 1" in same.stdout
    assert len(_get(f"{server.url}/draft/status")["rollbacks"]) == 1


def test_a_malformed_request_gets_vllms_4xx_and_serving_goes_on(server: Server, tiny_target: Path) -> None:
    body = json.dumps({"model": str(tiny_target), "prompt": "hi", "max_tokens": -3}).encode()
    req = urllib.request.Request(
        f"{server.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert 400 <= e.value.code < 500
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    assert _ask(client, str(tiny_target), server.ids[0]) == server.plain[0]
    assert _get(f"{server.url}/draft/status")["error"] is None


def test_ctrl_c_stops_everything_with_exit_130(server: Server) -> None:
    os.killpg(server.proc.pid, signal.SIGINT)
    rc = server.proc.wait(timeout=180)
    text = server.log.read_text()
    assert rc == 130, text[-3000:]
    last = [x for x in text.splitlines() if x.startswith("interrupted:")]
    assert len(last) == 1 and "checkpoints/serve" in last[0], text[-3000:]
    time.sleep(2)
    left = subprocess.run(
        ["pgrep", "-g", str(server.proc.pid)], capture_output=True, text=True
    ).stdout.split()
    assert left == [], f"processes left in the server's group: {left}"


def test_the_trained_draft_serves_with_stock_vllm(server: Server, tiny_target: Path) -> None:
    """The version the server served last (`latest`: version 1, rolled back to), as a folder, under stock vLLM's
    OpenAI server started with the line a run prints (`eval/summary.serve_command`): the same answers at
    temperature 0, and the draft proposes."""
    from openai import OpenAI

    assert server.proc.poll() is not None, "runs after the Ctrl-C test: one server at a time"
    folder = (server.run_dir / "checkpoints" / "serve" / "latest" / "draft").resolve()
    assert folder.name == "draft" and folder.parent.name == "v0001"
    with helpers.stock_vllm_server(tiny_target, folder, K, server.log.with_name("stock.log")) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        for p, want in zip(server.ids, server.plain, strict=True):
            assert _ask(client, str(tiny_target), p) == want
        metrics = _get(f"{url}/metrics")
    assert helpers.prom_counter(metrics, "vllm:spec_decode_num_draft_tokens_total") > 0


@pytest.fixture  # one test's: stopped when it ends
def restarting(
    tiny_target: Path, models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A lenient guard and two candidates: the test kills the learner after the first."""
    yield from _start(
        tiny_target,
        models,
        tmp_path_factory.mktemp("restarting"),
        "serve.guard_margin=1.0",
        "serve.max_versions=2",
    )


def _traffic_until(server: Server, tiny_target: Path, done: Any, timeout: float = 900) -> dict[str, Any]:
    """Rounds of the prompts at temperature 0, each answer checked against plain decoding, until ``done(status)``."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    deadline = time.monotonic() + timeout
    while True:
        for p, want in zip(server.ids, server.plain, strict=True):
            assert _ask(client, str(tiny_target), p) == want
        status = _get(f"{server.url}/draft/status")
        if done(status):
            return status
        assert status["error"] is None, status
        assert time.monotonic() < deadline, f"{status}\n{server.log.read_text()[-3000:]}"


def test_a_refused_candidate_is_kept_and_not_served(refusing: Server, tiny_target: Path) -> None:
    status = _traffic_until(refusing, tiny_target, lambda s: s["refused"] == [1])
    status = _traffic_until(
        refusing, tiny_target, lambda s: True
    )  # answers after the refusal: still the target's
    print(f"status: {status}")
    assert status["version"] == 0 and status["published"] == [0] and not status["learning"]
    root = refusing.run_dir / "checkpoints" / "serve"
    assert (root / "refused" / "v0001" / "draft" / "config.json").is_file() and not (root / "latest").exists()
    rows = [json.loads(x) for x in (refusing.run_dir / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r.get("stage") == "serve"]
    assert row["decision"] == "refused" and "held-back requests: the lower end is below +1" in row["why"]
    assert row["guard_n"] == 2 and row["refit_s"] == 0.0
    log = refusing.log.read_text()
    assert (
        "[serve] candidate 1 refused (" in log
        and "refit" not in log.split("candidate 1 refused")[1].splitlines()[0]
    )


def test_a_killed_learner_comes_back_from_its_checkpoint_and_the_server_serves_on(
    restarting: Server, tiny_target: Path
) -> None:
    """The learner's Ray actor (its process) killed after it published version 1: answers go on (the target's),
    the next step finds it dead, the learner is restarted from version 1's checkpoint (its draft and the optimizer
    state saved with it), and its next candidate is published."""
    import psutil

    def learners() -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if (
                    "ray::Learner" in " ".join(p.info["cmdline"] or [])
                    and os.getsid(p.pid) == restarting.proc.pid
                ):
                    out.append(p)
            except (psutil.Error, OSError):
                continue
        return out

    _traffic_until(restarting, tiny_target, lambda s: s["published"] == [0, 1])
    assert (restarting.run_dir / "checkpoints" / "serve" / "optimizer.pt").is_file()
    (first,) = learners()
    first.kill()
    first.wait(timeout=30)
    status = _traffic_until(restarting, tiny_target, lambda s: s["published"] == [0, 1, 2])
    print(f"status: {status}")
    assert status["learner_restarts"] == 1 and status["error"] is None
    (second,) = learners()
    assert second.pid != first.pid
    rows = [json.loads(x) for x in (restarting.run_dir / "metrics.jsonl").read_text().splitlines()]
    serve = [r for r in rows if r.get("stage") == "serve"]
    assert [r["decision"] for r in serve] == ["published", "learner_restarted", "published"]
    assert serve[1]["optimizer"] == "restored"
    assert "restarted from version 1, its optimizer restored" in restarting.log.read_text()
