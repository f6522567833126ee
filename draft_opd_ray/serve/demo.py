"""`make serve-demo` (`python -m draft_opd_ray.serve.demo`): the server that learns from its traffic against the same
server with its draft held fixed, on the same replayed ShareGPT train traffic.

Two arms, one after the other on this machine (two servers at once would share its cores): `learning`
(`python -m draft_opd_ray.serve`, the embedded target and its warm start) and `static` (`serve.learn=false`, the
same draft). Each is started as a user starts it, and a load generator sends the same train prompts (ones the warm
start never saw) in the same order through the `openai` client at a fixed concurrency, greedy. Then each server is
stopped with SIGINT.

What the report holds (`<out>/report.json`, `report.md`, `tau_over_time.png`): the wall time; per arm τ in equal
windows of requests in the order they finished, with 95% bootstrap intervals (the server's own per-request counts,
`traffic.jsonl`), and the learning arm minus the static one on the same prompts in the first and the last window
(paired by prompt); requests served and failed; p50 / p99 latency, with and without a refit while the request was in
flight; the candidates published and refused. A tie is reported as a tie.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ARMS = ("learning", "static")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m draft_opd_ray.serve.demo", description=__doc__.splitlines()[0]
    )
    p.add_argument("--requests", type=int, default=96, help="train prompts replayed through each arm")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    p.add_argument(
        "--max-tokens", type=int, default=128, help="new tokens per request (ignore_eos: all of them)"
    )
    p.add_argument(
        "--windows", type=int, default=4, help="equal windows of finished requests for τ over time"
    )
    p.add_argument("--out", default=None, help="the demo's folder (default outputs/serve_demo/<date>_<time>)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument(
        "overrides",
        nargs="*",
        help="config overrides for both servers (default: a version every 24 requests, the guard on the last 8 "
        "of every 4th)",
    )
    args = p.parse_args(argv)
    if args.requests < args.windows * 2 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--requests must be at least 2 per window; --concurrency and --max-tokens at least 1")
    return args


def train_prompts(n: int) -> list[list[int]]:
    """``n`` ShareGPT train prompts the warm start never saw, as `main`'s Draft-OPD stage orders them."""
    from draft_opd_ray.config.schema import Config
    from draft_opd_ray.driver import load_prompts, opd_prompts, prepare_target

    cfg = Config()
    _, tokenizer, _ = prepare_target(cfg)
    prompts = opd_prompts(cfg, load_prompts(cfg, tokenizer, "train"))
    if len(prompts) < n:
        raise SystemExit(f"error: --requests {n}: only {len(prompts)} train prompts")
    return prompts[:n]


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read().decode())


def start(arm: str, out: Path, port: int, overrides: list[str]) -> subprocess.Popen[bytes]:
    """The arm's server, as `python -m draft_opd_ray.serve` with the overrides; returns once it answers."""
    learn = "true" if arm == "learning" else "false"
    cmd = [
        sys.executable,
        "-m",
        "draft_opd_ray.serve",
        f"serve.port={port}",
        f"serve.learn={learn}",
        "serve.requests_per_update=24",
        "serve.guard_requests=8",
        "wandb.mode=disabled",
        f"hydra.run.dir={out / arm}",
        *overrides,
    ]
    log = (out / f"{arm}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 1800  # a first run trains the warm start first
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"error: the {arm} server exited with {proc.returncode}: see {out / f'{arm}.log'}"
            )
        try:
            _get(f"http://127.0.0.1:{port}/draft/status")
            return proc
        except OSError:
            time.sleep(2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"error: the {arm} server did not answer within 30 min: see {out / f'{arm}.log'}")


def load(port: int, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[dict[str, Any]]:
    """Every prompt through the server at ``concurrency``, greedy: start, end, ok per request, in prompt order."""
    from openai import OpenAI

    from draft_opd_ray.serve.server import prompt_key

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def one(ids: list[int]) -> dict[str, Any]:
        t0 = time.time()
        try:
            client.completions.create(
                model=model,
                prompt=ids,
                max_tokens=max_tokens,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            ok = True
        except Exception as e:  # noqa: BLE001 - a failed request is a number the report gives
            print(f"[demo] request failed: {type(e).__name__}: {e}", flush=True)
            ok = False
        return {"prompt": prompt_key(ids), "start": t0, "end": time.time(), "ok": ok}

    done: list[dict[str, Any]] = []
    with ThreadPoolExecutor(concurrency) as pool:
        for i, r in enumerate(pool.map(one, prompts), 1):
            done.append(r)
            if i % max(1, len(prompts) // 10) == 0:
                print(f"[demo] {i}/{len(prompts)} requests", flush=True)
    return done


def stop(proc: subprocess.Popen[bytes], port: int, wait_s: float = 300) -> int:
    """SIGINT once the server has closed every request it served (its status says none is open; a learner step in
    progress delays its next take), or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            status = _get(f"http://127.0.0.1:{port}/draft/status")
        except OSError:
            break
        if status["open_requests"] == 0 and status["requests"] > 0:
            break
        time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def windows(rows: list[dict[str, Any]], n: int) -> list[list[dict[str, Any]]]:
    """``rows`` in the order they closed, split into ``n`` windows of equal size (the last takes the rest)."""
    rows = sorted(rows, key=lambda r: r["closed_at"])
    size = len(rows) // n
    return [rows[i * size : (i + 1) * size if i < n - 1 else len(rows)] for i in range(n)]


def latency(calls: list[dict[str, Any]], refits: list[tuple[float, float]]) -> dict[str, Any]:
    """p50 / p99 of the requests that succeeded, split by whether a refit happened while they were in flight."""

    def pct(xs: list[float]) -> dict[str, float]:
        if not xs:
            return {"n": 0, "p50": float("nan"), "p99": float("nan")}
        a = np.asarray(xs)
        return {"n": int(a.size), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}

    ok = [c for c in calls if c["ok"]]
    hit = [c for c in ok if any(c["start"] <= t1 and t0 <= c["end"] for t0, t1 in refits)]
    miss = [c for c in ok if c not in hit]
    return {
        "all": pct([c["end"] - c["start"] for c in ok]),
        "refit_in_flight": pct([c["end"] - c["start"] for c in hit]),
        "no_refit": pct([c["end"] - c["start"] for c in miss]),
    }


def analyse(
    out: Path, calls: dict[str, list[dict[str, Any]]], n_windows: int, wall_s: float
) -> dict[str, Any]:
    from draft_opd_ray.eval.stats import bootstrap_ci, paired_diff

    report: dict[str, Any] = {"wall_s": wall_s, "arms": {}}
    by_arm = {arm: read_jsonl(out / arm / "traffic.jsonl") for arm in ARMS}
    for arm in ARMS:
        rows = by_arm[arm]
        decisions = [r for r in read_jsonl(out / arm / "metrics.jsonl") if r.get("stage") == "serve"]
        refits = [
            (r["refit_at"], r["refit_at"] + r["refit_s"]) for r in decisions if r["decision"] == "published"
        ]
        report["arms"][arm] = {
            "requests_sent": len(calls[arm]),
            "requests_failed": sum(not c["ok"] for c in calls[arm]),
            "requests_captured": len(rows),
            "tau": bootstrap_ci(rows),
            "tau_by_window": [bootstrap_ci(w) for w in windows(rows, n_windows)],
            # the draft versions that drafted each window's requests: [first, last]
            "versions_by_window": [
                [
                    min((r["first_version"] for r in w), default=0),
                    max((r["last_version"] for r in w), default=0),
                ]
                for w in windows(rows, n_windows)
            ],
            "published": [r["step"] for r in decisions if r["decision"] == "published"],
            "refused": [r["step"] for r in decisions if r["decision"] == "refused"],
            "refits_at": [t0 for t0, _ in refits],
            "latency_s": latency(calls[arm], refits),
        }
    static = {r["prompt"]: r for r in by_arm["static"]}
    for name, w in (("first", 0), ("last", n_windows - 1)):
        learn = [r for r in windows(by_arm["learning"], n_windows)[w] if r["prompt"] in static]
        report[f"learning_minus_static_{name}_window"] = paired_diff(
            learn, [static[r["prompt"]] for r in learn]
        )
    return report


def verdict(d: dict[str, float]) -> str:
    if not d.get("n"):
        return "no paired requests"
    if d["pooled_lo"] > 0:
        return "learning above static"
    if d["pooled_hi"] < 0:
        return "learning below static"
    return "a tie (the interval holds 0)"


def render(report: dict[str, Any]) -> str:
    def ci(x: dict[str, float]) -> str:
        return f"{x['tau']:.3f} [{x['lo']:.3f}, {x['hi']:.3f}] (n={x['n']})"

    lines = [f"serve demo: {report['wall_s'] / 60:.1f} min wall", ""]
    for arm, a in report["arms"].items():
        lat = a["latency_s"]
        lines += [
            f"{arm}: {a['requests_sent']} requests sent, {a['requests_failed']} failed; tau {ci(a['tau'])}",
            "  tau by window: " + " | ".join(ci(w) for w in a["tau_by_window"]),
            f"  published {a['published'] or 'none'}, refused {a['refused'] or 'none'}",
            f"  latency p50 / p99: {lat['all']['p50']:.2f} / {lat['all']['p99']:.2f} s; with a refit in flight "
            f"{lat['refit_in_flight']['p50']:.2f} / {lat['refit_in_flight']['p99']:.2f} s "
            f"(n={lat['refit_in_flight']['n']}), without {lat['no_refit']['p50']:.2f} / "
            f"{lat['no_refit']['p99']:.2f} s (n={lat['no_refit']['n']})",
        ]
    for name in ("first", "last"):
        d = report[f"learning_minus_static_{name}_window"]
        lines.append(
            f"learning - static, {name} window, same prompts: {d['pooled']:+.4f} "
            f"[{d['pooled_lo']:+.4f}, {d['pooled_hi']:+.4f}] (n={d['n']}): {verdict(d)}"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, a in report["arms"].items():
        w = a["tau_by_window"]
        x = np.arange(1, len(w) + 1)
        y = np.array([v["tau"] for v in w])
        err = np.array([[v["tau"] - v["lo"] for v in w], [v["hi"] - v["tau"] for v in w]])
        ax.errorbar(
            x,
            y,
            yerr=err,
            marker="o",
            capsize=3,
            label=f"{arm} ({', '.join(map(str, a['published'])) or '-'})",
        )
        if a["published"]:  # which versions drafted each window of the learning arm
            for xi, yi, (v0, v1) in zip(x, y, a.get("versions_by_window", []), strict=False):
                label = f"v{v0}" if v0 == v1 else f"v{v0}-{v1}"
                ax.annotate(label, (xi, yi), textcoords="offset points", xytext=(8, -12), fontsize=8)
    ax.set_xticks(range(1, max(len(a["tau_by_window"]) for a in report["arms"].values()) + 1))
    ax.set_xlabel("window of finished requests (in the order they finished)")
    ax.set_ylabel("served τ (committed tokens per verification step)")
    ax.set_title(
        "Served τ over time: the draft learning from its traffic vs held fixed\n(same ShareGPT train prompts, 95% CI)"
    )
    ax.legend(
        title="arm (versions published; vN: the versions that drafted a window)",
        loc="lower right",
        fontsize=8,
        title_fontsize=8,
    )
    fig.tight_layout()
    path = out / "tau_over_time.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    out = Path(args.out or f"outputs/serve_demo/{time.strftime('%Y-%m-%d_%H-%M-%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    prompts = train_prompts(args.requests)
    calls: dict[str, list[dict[str, Any]]] = {}
    for arm in ARMS:
        print(f"[demo] {arm}: starting the server ({out / f'{arm}.log'})", flush=True)
        proc = start(arm, out, args.port, list(args.overrides))
        try:
            calls[arm] = load(args.port, prompts, args.concurrency, args.max_tokens)
        finally:
            rc = stop(proc, args.port)
        print(f"[demo] {arm}: {len(calls[arm])} requests, server stopped (exit {rc})", flush=True)
        (out / f"{arm}_requests.json").write_text(json.dumps(calls[arm]))
    report = analyse(out, calls, args.windows, time.monotonic() - t0)
    report["plot"] = str(plot(report, out))
    report["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=float))
    text = render(report)
    (out / "report.md").write_text(text + "\n")
    print(text + f"\nplot: {report['plot']}\nreport: {out / 'report.json'}", flush=True)


if __name__ == "__main__":
    main()
