"""vLLM's OpenAI-compatible server whose draft learns from the traffic it verifies.

The server is vLLM's own: its argument parser (`launchers/cli_args.py`), engine client (`AsyncLLM`, built by
`build_async_engine_client`), FastAPI app and routes (`build_app`, `init_app_state`) and uvicorn launcher
(`serve_http`), called in the order vLLM's `run_server_worker` calls them. What this module adds:

* the engine starts with our worker extension (`rollout/worker_ext.py`), and the verify-pass capture is installed
  through it once the engine is up (the same capture the rollouts use: the teacher of every verification step);
* one route, ``GET /draft/status`` (JSON: the version served, the versions published, τ by version, requests);
* a task on the server's event loop: every `serve.poll_s` it takes the captured steps from the engine
  (`AsyncLLM.collective_rpc`, inside this process: no development endpoint is opened), joins them into requests
  (`serve/traffic.py`), and after `serve.requests_per_update` closed requests runs a learner step in a thread
  (`serve/learn.py`), writes the new version to a file the engine's workers reload in place, and checks the refit
  proof (`sync/refit.py`: the engine's read-back of every draft tensor against the published weights). A refit
  that fails its proof is rolled back to the served version. Each published version is saved under
  `<run dir>/checkpoints/serve/`, and a row goes to `metrics.jsonl`;
* the same task takes a rollback request (`serve/rollback.py`, written by `python -m draft_opd_ray.serve.rollback`)
  and refits the published version it names.

Speculative decoding is lossless: every answer is the target's, whichever version drafts it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draft_opd_ray.config.schema import Config
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.serve import rollback
from draft_opd_ray.serve.learn import moments
from draft_opd_ray.serve.placement import serve_split
from draft_opd_ray.serve.rollback import STATUS_ROUTE
from draft_opd_ray.serve.traffic import Traffic


def check(cfg: Config) -> None:
    """The server's own checks after the config's: its address is free, and on GPUs the learner's side fits
    beside the engine (`serve/placement.py`)."""
    check_port(cfg.serve.host, cfg.serve.port)
    if cfg.serve.learn:
        from draft_opd_ray.serve.transfer import server_transport

        server_transport(cfg, serve_split(cfg))


def stopped(run_dir: Path) -> str:
    """The closing line of a stopped server: the draft it served last."""
    served = run_dir / "checkpoints" / "serve" / "latest"
    if served.exists():
        return f"the server stopped; the draft it served last is {served.resolve()}/draft"
    return "the server stopped; it served the draft it started with (no new version, or rolled back to it)"


def check_port(host: str, port: int) -> None:
    """The server's address is free (before any model loads): a port another process listens on is a config error
    (connections of a server that just stopped, still in TIME_WAIT there, are not)."""
    with socket.socket() as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as the server binds: only a listener blocks it
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(
                f"serve.port: cannot listen on {host}:{port} ({e.strerror or e}); pick another port"
            ) from None


def describe(cfg: Config, sized: list[Any] | None = None) -> str:
    """What `python -m draft_opd_ray.serve` will start (its dry run prints this and stops)."""
    from draft_opd_ray.opd.source import teacher_source

    d, s = cfg.draft, cfg.serve
    src = teacher_source(cfg.teacher, cfg.loss, cfg.replay)
    lines = [
        f"serve: vLLM's OpenAI server on http://{s.host}:{s.port}/v1, status at {STATUS_ROUTE}",
        f"target: {cfg.target.path} ({cfg.target.dtype}, max_model_len {cfg.target.max_model_len})",
        f"draft:  {d.kind} (K={d.num_speculative_tokens}) from "
        + (d.path or "the warm start (cached, else trained first as the sft stage trains it)"),
        (
            f"learning: Draft-OPD on the served traffic, a version every {s.requests_per_update} requests "
            f"({cfg.learner.mini_batches} optimizer updates each), {s.max_versions} at most; objective {cfg.loss.objective}, "
            f"gamma {cfg.loss.gamma}, anchors {cfg.anchor.policy}; teacher: {src.name} ({src.why})"
            if s.learn
            else "learning: off (serve.learn=false): the draft is served as it is"
        ),
    ]
    if s.learn:
        from draft_opd_ray.serve.transfer import server_transport

        split = serve_split(cfg)
        if split is not None:
            lines.append(split.describe())
        lines.append(
            "refit: vLLM's draft weight transfer, NCCL from the learner's GPU"
            if server_transport(cfg, split) == "nccl"
            else "refit: a weights file our worker extension loads in place"
        )
    if sized:
        from draft_opd_ray.sizing import render

        lines.append(render(sized))
    return "\n".join(lines)


def vllm_argv(
    cfg: Config, target: str, spec: dict[str, Any], capture_features: bool, nccl: bool = False
) -> list[str]:
    """The command line vLLM's own server gets (what `vllm serve` would be given), from the run's config; ``nccl``:
    the engine takes new draft versions through vLLM's weight transfer, backend NCCL (`serve/transfer.py`)."""
    from draft_opd_ray.device import resolve_dtype
    from draft_opd_ray.logs import tqdm_on_load
    from draft_opd_ray.rollout.engine import needs_eager
    from draft_opd_ray.rollout.worker_ext import EXTENSION

    argv = [
        *("--model", target, "--host", cfg.serve.host, "--port", str(cfg.serve.port)),
        *("--dtype", resolve_dtype(cfg.target.dtype), "--max-model-len", str(cfg.target.model_len())),
        *("--seed", str(cfg.seed), "--speculative-config", json.dumps(spec)),
        *(
            "--worker-extension-cls",
            EXTENSION,
            "--tensor-parallel-size",
            str(cfg.cluster.rollout_tensor_parallel),
        ),
        *(
            "--gpu-memory-utilization",
            str(cfg.rollout.gpu_memory_utilization),
            "--disable-uvicorn-access-log",
        ),
    ]
    if not tqdm_on_load():  # a quiet run: no weight-loading bars (logs.py)
        argv.append("--no-use-tqdm-on-load")
    if needs_eager():
        argv.append("--enforce-eager")
    if capture_features:  # a prefix-cache hit computes no prompt rows: the captured features would miss them
        argv.append("--no-enable-prefix-caching")
    if nccl:
        from draft_opd_ray.serve.transfer import BACKEND

        argv += ["--weight-transfer-config", json.dumps(BACKEND)]
    return argv


def vllm_args(argv: list[str]) -> Any:
    """vLLM's parsed and checked server arguments (its own parser and checks)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


@dataclass
class Status:
    """What `GET /draft/status` returns, and what the learning task updates."""

    learning: bool
    version: int = 0
    published: list[int] = field(default_factory=lambda: [0])
    refused: list[int] = field(default_factory=list)
    traffic: Traffic = field(default_factory=Traffic)
    error: str | None = None
    learner_restarts: int = 0
    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # each request taken: to, from, error, ...

    def as_dict(self) -> dict[str, Any]:
        t = self.traffic
        return {
            "version": self.version,
            "published": list(self.published),
            "refused": list(self.refused),
            "tau_by_version": {str(v): x for v, x in t.tau_by_version().items()},
            "requests": t.requests,
            "open_requests": len(t.open),
            "orphans": t.orphans,
            "learning": self.learning,
            "learner_restarts": self.learner_restarts,
            "rollbacks": list(self.rollbacks),
            "error": self.error,
        }


class Refitter:
    """The learning task's side of the engine: take the captured traffic, refit a new version, prove it."""

    def __init__(
        self,
        client: Any,
        cfg: Config,
        status: Status,
        run_dir: Path,
        metrics: Any,
        draft: str,
        counters: Any = None,
    ) -> None:
        self.client, self.cfg, self.status, self.run_dir, self.metrics = client, cfg, status, run_dir, metrics
        self.counters = (
            counters  # `serve/counters.py`: by-version counts on vLLM's /metrics (None: none kept)
        )
        self.draft = draft  # the folder the server started with
        self.keys: set[str] | None = None  # the tensor names a refit sends (set by the first one)
        self.transfer: Any = (
            None  # `serve/transfer.NcclRefit` on GPUs where it fits; None: the file transport
        )

    async def take(self) -> list[Any]:
        """The requests the capture closed since the last take (steps of rank 0: every rank sees the same)."""
        from draft_opd_ray.rollout.verify_capture import decode

        taken = (await self.client.collective_rpc("take_verify_capture"))[0]
        steps = {rid: decode(d) for rid, d in taken.items()}
        closed = self.status.traffic.add(steps, self.status.version)
        if closed:
            log_requests(self.run_dir / "traffic.jsonl", closed)
            if self.counters is not None:
                self.counters.add(closed)
        return closed

    def decided(self, step: int, decision: str, **row: Any) -> None:
        """A decision of the learning task (published, refused, dropped, learner_restarted, rolled_back, ...): a
        `serve` row of `metrics.jsonl`, and the Prometheus counters."""
        self.metrics.log("serve", step, decision=decision, **row)
        if self.counters is not None:
            self.counters.decided(decision, self.status.version)

    async def refit(self, weights: dict[str, Any], version: int, from_learner: bool = True) -> float:
        """Load ``weights`` as ``version`` into the running engine and check the engine's read-back against them;
        returns the seconds it took. The requests in flight go on (their next steps are drafted by the new
        version). ``from_learner``: they are the learner rank's current draft (NCCL can send them, where it is
        the transport), not a folder's. A load that fails its proof is undone: the served version is loaded back
        (from its folder) and proved, and `RefitRolledBack` says so."""
        from draft_opd_ray.errors import RefitError

        t0 = time.perf_counter()
        self.keys = set(weights)
        try:
            await self._load_and_prove(weights, version, from_learner)
        except RefitError as e:  # back to what was served, proved too: the candidate never serves
            folder = Path(served_draft(self.run_dir, self.draft))
            await self._load_and_prove(folder_weights(folder, set(weights)), self.status.version, False)
            raise RefitRolledBack(f"{e}; rolled back to version {self.status.version}, proved") from None
        return time.perf_counter() - t0

    async def _load_and_prove(self, weights: dict[str, Any], version: int, from_learner: bool) -> None:
        import torch

        from draft_opd_ray.drafts import registry
        from draft_opd_ray.sync import receiver
        from draft_opd_ray.sync.refit import check_ack, fingerprints

        if from_learner and self.transfer is not None:
            await self.transfer.load(weights, version)
        else:
            with receiver.weights_file(weights) as path:
                await self.client.collective_rpc("load_draft_weights", args=(path, version))
        await self.client.reset_prefix_cache()  # blocks of finished requests hold the old draft's KV
        ranks = await self.client.collective_rpc("draft_fingerprints")
        kind = registry.KINDS[self.cfg.draft.kind]
        ack = receiver.ack_from_ranks(
            ranks, self.client.vllm_config, "the server's engine", kind.vllm_aliases
        )
        check_ack(ack, version, {ack.dtype: fingerprints(weights.items(), getattr(torch, ack.dtype))})

    async def roll_back(self, learner: Any, feed: Feed, request: dict[str, Any]) -> Any:
        """A rollback request (`serve/rollback.py`): the published version it names refit into the engine and
        proved, `latest` pointed at it, the training queue emptied (its requests were drafted by the version left),
        and the learner restarted from it (or stopped, with ``freeze``). Returns the learner, None once stopped.
        The answer is listed in the status's `rollbacks` and is a row of `metrics.jsonl`."""
        status = self.status
        to, served = request.get("version"), status.version
        entry: dict[str, Any] = {"id": request.get("id"), "to": to, "from": served, "at": time.time()}
        entry.update(error=request.get("error"), refit_s=0.0)
        if entry["error"] is None and (not isinstance(to, int) or to not in status.published):
            entry["error"] = (
                f"version {to} was never published by this server (published: {status.published})"
            )
        if isinstance(to, int) and entry["error"] is None and to != served:
            folder = version_folder(self.run_dir, self.draft, to)
            try:
                weights = folder_weights(folder, self.keys)
                entry["refit_s"] = round(await self.refit(weights, to, from_learner=False), 3)
            except RefitRolledBack as e:
                entry["error"] = str(e)
            else:
                status.version = to
                point_served(self.run_dir, to)
                feed.pending.clear()
                if learner is not None and not request.get("freeze"):
                    saved = moments(self.run_dir / "checkpoints" / "serve", to)
                    await self.restart_learner(learner, str(folder), False, saved)
                    entry["learner"] = f"the learner restarted from version {to}"
                elif learner is None:
                    entry["learner"] = "no learner runs: the server serves it as it is"
        if entry["error"] is None and request.get("freeze") and learner is not None:
            learner, status.learning = None, False
            entry["learner"] = "learning stopped"
        status.rollbacks.append(entry)
        decision = "rolled_back" if entry["error"] is None else "rollback_failed"
        row = {k: v for k, v in entry.items() if k != "id" and v is not None}
        self.decided(max(status.published + status.refused), decision, **row)
        print(
            f"[serve] rollback to version {to}: "
            + (entry["error"] or f"served again (was {served}; refit {entry['refit_s']:.2f} s, proved)"),
            flush=True,
        )
        return learner

    async def restart_learner(self, learner: Any, folder: str, failed: bool, saved: Any) -> None:
        """`TrafficLearner.restart` in a thread; its new rank 0 is the NCCL path's new sender."""
        await asyncio.to_thread(learner.restart, folder, failed, saved)
        if self.transfer is not None:
            self.transfer.sender_changed(learner.learner.rank0)


def folder_weights(folder: Path | str, keys: set[str] | None) -> dict[str, Any]:
    """A draft folder's tensors that a refit sends (``keys``; all of them when no refit has run yet)."""
    from safetensors.torch import load_file

    got = load_file(str(Path(folder) / "model.safetensors"))
    return {k: v for k, v in got.items() if keys is None or k in keys}


def version_folder(run_dir: Path, first: str, version: int) -> Path:
    """The draft folder of a published version: version 0 is the one the server started with."""
    return Path(first) if version == 0 else run_dir / "checkpoints" / "serve" / f"v{version:04d}" / "draft"


def point_served(run_dir: Path, version: int) -> None:
    """`checkpoints/serve/latest` names the served version (none for version 0: `served_draft` then gives the
    folder the server started with)."""
    from draft_opd_ray.checkpoint import LATEST, point_latest

    root = run_dir / "checkpoints" / "serve"
    if version == 0:
        (root / LATEST).unlink(missing_ok=True)
    else:
        point_latest(root, f"v{version:04d}")


class RefitRolledBack(Exception):
    """A candidate's refit failed its proof and the served version was loaded back (and proved)."""


def learner_failures() -> tuple[type[BaseException], ...]:
    """What a learner step raises when an actor died or timed out (imported when needed: Ray loads slowly)."""
    from ray.exceptions import RayActorError

    from draft_opd_ray.errors import RunError

    return (RunError, RayActorError)


def served_draft(run_dir: Path, first: str) -> str:
    """The folder of the draft the server serves: the version `latest` names (the last published one, or the one
    rolled back to), else the one it started with."""
    latest = run_dir / "checkpoints" / "serve" / "latest" / "draft"
    return str(latest.resolve()) if latest.exists() else first


class Feed:
    """The closed requests, split as they close: every `serve.holdout_every`-th is held back for the guard (the last
    `serve.guard_requests` of them), the others wait to be trained on."""

    def __init__(self, cfg: Config) -> None:
        self.every, self.guard = cfg.serve.holdout_every, cfg.serve.guard
        self.held: collections.deque[Any] = collections.deque(maxlen=cfg.serve.guard_requests)
        self.pending: list[Any] = []
        self.seen = 0

    def add(self, records: list[Any]) -> None:
        for r in records:
            self.seen += 1
            (self.held if self.guard and self.seen % self.every == 0 else self.pending).append(r)

    def ready(self, n: int) -> bool:
        """``n`` requests to train on, and (with the guard) a full held-back slice to judge the result on."""
        full = not self.guard or len(self.held) == self.held.maxlen
        return full and len(self.pending) >= n

    def batch(self) -> list[Any]:
        out, self.pending = self.pending, []
        return out


def step_and_judge(learner: Any, batch: list[Any], held: list[Any]) -> tuple[dict[str, Any], Any, Any]:
    """One learner step on ``batch`` and the guard's decision on its candidate from ``held`` (blocking: run in a
    thread); the decision is None without a guard or a candidate."""
    row, weights = learner.step(batch)
    decision = learner.judge(held, weights) if weights and learner.guard is not None else None
    return row, weights, decision


async def learn(refitter: Refitter, learner: Any) -> None:
    """The learning task: take the traffic every `serve.poll_s`; once `serve.requests_per_update` requests wait (and
    the guard's held-back slice is full), start a learner step and the guard's judgement in a thread, and go on
    taking the traffic beside it (requests close on time); when it is done, publish or refuse the candidate
    (`publish`). A learner that fails is restarted from the served draft; the server serves on. The learner stops
    after `serve.max_versions` candidates. A rollback request is taken at a poll with no step in flight
    (`Refitter.roll_back`); a candidate that finished training after one was asked for is dropped."""
    cfg, status = refitter.cfg, refitter.status
    feed = Feed(cfg)
    stepping: asyncio.Task[tuple[dict[str, Any], Any, Any]] | None = None
    batch: list[Any] = []
    t0 = 0.0
    while True:
        await asyncio.sleep(cfg.serve.poll_s)
        feed.add(await refitter.take())
        if stepping is None:
            if (request := rollback.take_request(refitter.run_dir)) is not None:
                learner = await refitter.roll_back(learner, feed, request)
            elif learner is not None and feed.ready(cfg.serve.requests_per_update):
                batch, t0 = feed.batch(), time.perf_counter()
                held = list(feed.held)
                stepping = asyncio.create_task(asyncio.to_thread(step_and_judge, learner, batch, held))
            continue
        if not stepping.done():
            continue
        done, stepping = stepping, None
        try:
            row, weights, decision = done.result()
        except learner_failures() as e:
            saved = moments(refitter.run_dir / "checkpoints" / "serve", status.version)
            await refitter.restart_learner(
                learner, served_draft(refitter.run_dir, refitter.draft), True, saved
            )
            status.learner_restarts = learner.restarts
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            optimizer = "restored" if saved is not None else "started over"
            refitter.decided(learner.steps, "learner_restarted", why=why, optimizer=optimizer)
            print(
                f"[serve] the learner failed ({why}); restarted from version {status.version}, its optimizer "
                f"{optimizer}",
                flush=True,
            )
            continue
        if weights and rollback.waiting(refitter.run_dir):
            refitter.decided(learner.steps, "dropped", why="a rollback was asked for")
            print(f"[serve] candidate {learner.steps} dropped: a rollback was asked for", flush=True)
        elif weights:
            await publish(
                refitter, learner, feed, (row, weights, decision), len(batch), time.perf_counter() - t0
            )
        if learner.steps >= cfg.serve.max_versions:
            print(
                f"[serve] serve.max_versions={learner.steps} reached: the learner stops, the server serves on",
                flush=True,
            )
            learner = None
            status.learning = False


async def publish(
    refitter: Refitter,
    learner: Any,
    feed: Feed,
    stepped: tuple[dict[str, Any], Any, Any],
    n: int,
    step_s: float,
) -> None:
    """A candidate the guard let through (or every one with `serve.guard=false`) is refit into the engine and proved;
    a refit that fails its proof is rolled back to the served version (`Refitter.refit`) and the candidate refused;
    a candidate the guard refused is kept on disk. Each decision is a row of `metrics.jsonl`."""
    row, weights, decision = stepped
    status = refitter.status
    candidate, served = learner.steps, status.version
    why = decision.why if decision is not None else "serve.guard=false"
    refit_s, refit_at = 0.0, float("nan")
    if decision is None or decision.publish:
        feed.add(await refitter.take())  # steps drafted by the serving version until the refit below
        refit_at = time.time()
        try:
            refit_s = await refitter.refit(weights, candidate)
        except RefitRolledBack as e:
            why = str(e)
        else:
            await asyncio.to_thread(learner.published)
            status.version = candidate
            status.published.append(candidate)
    what = "published" if status.version == candidate else "refused"
    if what == "refused":
        status.refused.append(candidate)
    await asyncio.to_thread(save_version, learner, refitter.run_dir, candidate, what)
    if what == "published":
        await asyncio.to_thread(learner.save_moments, refitter.run_dir / "checkpoints" / "serve", candidate)
    tau = status.traffic.tau_by_version().get(served, float("nan"))
    guard = {} if decision is None else {f"guard_{k}": v for k, v in decision.diff.items()}
    refitter.decided(
        candidate,
        what,
        why=why,
        requests=n,
        served_requests=status.traffic.requests,
        tau_serving=tau,
        step_s=step_s,
        refit_s=refit_s,
        refit_at=refit_at,  # wall clock (seconds since the epoch): requests in flight then saw the refit
        **guard,
        **{k: v for k, v in row.items() if isinstance(v, (int, float))},
    )
    print(
        f"[serve] candidate {candidate} {what} ({why}): trained on {n} requests "
        f"({int(row.get('anchors', 0))} anchors)"
        + (f", refit {refit_s:.2f} s, proved" if what == "published" else "")
        + f"; served tau of version {served}: {tau:.3f}",
        flush=True,
    )


def log_requests(path: Path, records: list[Any]) -> None:
    """One line per closed request in `traffic.jsonl`: when it closed, its sizes, its verification steps, the
    drafted tokens accepted and the versions that drafted them (the demo's τ over time reads these)."""
    from draft_opd_ray.metrics import json_line

    now = time.time()
    with path.open("a") as f:
        for r in records:
            f.write(
                json_line(
                    {
                        "closed_at": now,
                        "prompt": prompt_key(r.prompt_ids),
                        "prompt_tokens": len(r.prompt_ids),
                        "response_tokens": len(r.response_ids),
                        "steps": r.num_steps,
                        "accepted": sum(r.accepted),
                        "first_version": min(r.policy_version),
                        "last_version": max(r.policy_version),
                    }
                )
            )


def prompt_key(ids: list[int]) -> str:
    """A short hash of a prompt's ids: the same request in two runs (the demo pairs its arms by it)."""
    import hashlib

    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def save_version(learner: Any, run_dir: Path, version: int, what: str) -> Path:
    """The candidate's draft folder (atomic): a published one as `<run dir>/checkpoints/serve/v<version>/draft`
    (`latest` naming it), a refused one under `checkpoints/serve/refused/` (kept, not served)."""
    from draft_opd_ray.checkpoint import write_checkpoint
    from draft_opd_ray.waits import wait_for

    def fill(tmp: Path) -> None:
        wait_for(learner.learner.rank0.save.remote(str(tmp / "draft")), f"learner: save version {version}")

    root = run_dir / "checkpoints" / "serve"
    return write_checkpoint(root if what == "published" else root / "refused", f"v{version:04d}", fill)


async def run_server(
    args: Any,
    cfg: Config,
    capture: tuple[Any, ...],
    learner: Any,
    run_dir: Path,
    draft: str,
    transport: str = "file",
) -> Status:
    """vLLM's `run_server_worker`, with the capture installed, the status route and the learning task."""
    import vllm.envs as envs
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    from draft_opd_ray.logs import tqdm_on_load
    from draft_opd_ray.metrics import MetricsLogger
    from draft_opd_ray.serve.counters import VersionCounters

    status = Status(learning=learner is not None)
    metrics = MetricsLogger(
        run_dir, wandb_mode=cfg.wandb.mode, project=cfg.wandb.project, entity=cfg.wandb.entity
    )
    _, sock = setup_server(args, reuse_port=False)
    task = None
    try:
        async with build_async_engine_client(args) as client:
            await client.collective_rpc("install_verify_capture", args=capture)
            tasks = await client.get_supported_tasks()
            app = build_app(args, tasks, client.model_config)
            await init_app_state(client, app.state, args, tasks)
            app.add_api_route(STATUS_ROUTE, lambda: JSONResponse(status.as_dict()), methods=["GET"])
            refitter = Refitter(client, cfg, status, run_dir, metrics, draft, VersionCounters())
            if transport == "nccl" and learner is not None:
                from draft_opd_ray.serve.transfer import NcclRefit
                from draft_opd_ray.waits import timeout_s

                tp = cfg.cluster.rollout_tensor_parallel
                refitter.transfer = NcclRefit(client, learner.learner.rank0, tp, timeout_s())
            task = asyncio.create_task(learn(refitter, learner))
            task.add_done_callback(lambda t: _learning_stopped(t, status))
            url = f"http://{cfg.serve.host}:{cfg.serve.port}"
            print(
                f"[serve] vLLM's OpenAI server on {url}/v1 (model {args.model}); draft status: GET {url}{STATUS_ROUTE}",
                flush=True,
            )
            shutdown = await serve_http(
                app,
                sock=sock,
                host=args.host,
                port=args.port,
                # a quiet run: uvicorn's INFO lines (start-up, shutdown) stay off the console, as vLLM's do
                log_level=args.uvicorn_log_level if tqdm_on_load() else "warning",
                access_log=False,
                timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            )
        await shutdown
    finally:
        if task is not None:
            task.cancel()
        sock.close()
        metrics.close()
    return status


def _learning_stopped(task: asyncio.Task[None], status: Status) -> None:
    """A learning task that failed in a way it does not handle itself (a learner that fails is restarted, a refit
    that fails its proof rolled back): the server serves on with the last published version, and the status says
    why learning stopped."""
    if task.cancelled():
        return
    e = task.exception()
    if e is not None:
        status.learning = False
        status.error = f"{type(e).__name__}: {e}"
        print(f"[serve] learning stopped, serving version {status.version}: {status.error}", flush=True)


def serve(cfg: Config, run_dir: str) -> None:
    """The whole command: Ray, the target, the draft (`draft.path`, or the warm start: cached, else trained now),
    the learner beside the server when `serve.learn`, then vLLM's server until Ctrl-C or SIGTERM."""
    import os

    import ray
    import uvloop

    from draft_opd_ray import cluster, waits
    from draft_opd_ray.driver import load_prompts, prepare_target
    from draft_opd_ray.loop.actors import capture_settings
    from draft_opd_ray.rollout.engine import speculative_config
    from draft_opd_ray.serve.transfer import server_transport
    from draft_opd_ray.sft.stage import run_sft_stage

    rd = Path(run_dir)
    rd.mkdir(parents=True, exist_ok=True)
    waits.configure(cfg.cluster.actor_timeout_s)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(cfg.rollout.kvcache_gb)))
    split = serve_split(cfg) if cfg.serve.learn else None
    transport = server_transport(cfg, split) if cfg.serve.learn else "file"
    owned = cluster.connect(cfg, rd, gpus=None if split is None else split.ray)
    try:
        target, tokenizer, _ = prepare_target(cfg)
        draft = cfg.draft.path
        if draft is None:
            from draft_opd_ray.metrics import MetricsLogger

            with contextlib.closing(MetricsLogger(rd, wandb_mode="disabled")) as m:
                draft = str(
                    run_sft_stage(
                        cfg,
                        target=target,
                        prompts=load_prompts(cfg, tokenizer, "train"),
                        run_dir=rd,
                        metrics=m,
                    )
                )
        topk, vocab, features = capture_settings(cfg, target, draft)
        if topk is None:
            raise ConfigError(
                "serve: the server learns from the teacher captured in its verification pass; this config's "
                "teacher source is the replay (preflight says why): use loss.objective=opd loss.estimator=topk"
            )
        spec = speculative_config(cfg.draft.kind, draft, cfg.draft.num_speculative_tokens)
        assert spec is not None
        args = vllm_args(vllm_argv(cfg, target, spec, features, nccl=transport == "nccl"))
        learner = None
        if cfg.serve.learn:
            from draft_opd_ray.serve.learn import TrafficLearner

            learner = TrafficLearner(cfg, target, draft)
        print(
            f"[serve] draft {cfg.draft.kind} from {draft}; "
            + (
                f"learning from the traffic: a new version every {cfg.serve.requests_per_update} requests, "
                f"{cfg.serve.max_versions} at most"
                if learner is not None
                else "serve.learn=false: the draft stays as it is"
            ),
            flush=True,
        )
        status = uvloop.run(run_server(args, cfg, (topk, vocab, features), learner, rd, draft, transport))
        print(f"[serve] stopped: {json.dumps(status.as_dict())}", flush=True)
    finally:
        if owned:
            ray.shutdown()
