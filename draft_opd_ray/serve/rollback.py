"""`python -m draft_opd_ray.serve.rollback RUN_DIR VERSION`: a running server goes back to a draft it published.

The server's port serves only vLLM's routes and `GET /draft/status`, so the request goes through its run dir: this
command checks the version against the server's status, writes `<run dir>/rollback.json` (atomically), and waits
until the status lists the rollback. The server's learning task takes the request at its next poll (after a learner
step in flight, whose candidate is then dropped), refits that version's folder into the running engine, proves it
with the refit check, points `checkpoints/serve/latest` at it and restarts the learner from it (`--freeze` stops
the learning instead). Requests in flight go on; their next steps are drafted by the version rolled back to.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

STATUS_ROUTE = "/draft/status"  # the server's one route of its own (`server.py` adds it)
REQUEST = "rollback.json"  # in the run dir: written by the command, taken (read and removed) by the server
EXIT_BAD_INPUT = 2


class RollbackError(Exception):
    """A rollback that cannot be asked for (the message is the command's one `error:` line)."""


def take_request(run_dir: Path) -> dict[str, Any] | None:
    """The server's side: the waiting request, removed; None when there is none. A file that is not a request
    becomes one the server refuses (its `error` says why)."""
    path = run_dir / REQUEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    path.unlink(missing_ok=True)
    try:
        request = json.loads(text)
        if not isinstance(request, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        return {"id": None, "version": None, "error": f"{REQUEST} is not a rollback request ({e})"}
    return request


def waiting(run_dir: Path) -> bool:
    """A request waits (the server drops a candidate that finished training after it was asked for)."""
    return (run_dir / REQUEST).exists()


def refusal(status: dict[str, Any], version: int) -> str | None:
    """Why a server with ``status`` (its `GET /draft/status`) cannot go back to ``version``; None when it can."""
    if version not in status["published"]:
        return f"VERSION: version {version} was never published by this server (published: {status['published']})"
    return None


def server_url(run_dir: Path) -> str:
    """The server's address, from the run dir's composed config (`serve.host`, `serve.port`)."""
    import yaml

    path = run_dir / ".hydra" / "config.yaml"
    try:
        serve = (yaml.safe_load(path.read_text()) or {}).get("serve")
    except (OSError, yaml.YAMLError) as e:
        raise RollbackError(f"RUN_DIR: {run_dir} is not a server's run dir ({e})") from None
    if not isinstance(serve, dict) or "port" not in serve:
        raise RollbackError(f"RUN_DIR: {path} has no serve.port: not a server's run dir")
    host = serve.get("host") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{host}:{serve['port']}"


def get_status(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + STATUS_ROUTE, timeout=10) as r:
            return dict(json.loads(r.read().decode()))
    except OSError as e:
        raise RollbackError(
            f"RUN_DIR: no server answers at {url}{STATUS_ROUTE} (the run dir's serve.host and serve.port): "
            f"is it still running? ({getattr(e, 'reason', e)})"
        ) from None


def ask(run_dir: Path, version: int, freeze: bool, timeout: float) -> dict[str, Any]:
    """Write the request and wait for the server's answer: the entry its status lists under `rollbacks`."""
    from draft_opd_ray.checkpoint import write_text_atomic

    url = server_url(run_dir)
    status = get_status(url)
    if (why := refusal(status, version)) is not None:
        raise RollbackError(why)
    if status["version"] == version:
        return {"to": version, "from": version, "error": None, "refit_s": 0.0, "already": True}
    rid = uuid.uuid4().hex[:12]
    request = {"id": rid, "version": version, "freeze": freeze, "requested_at": time.time()}
    write_text_atomic(run_dir / REQUEST, json.dumps(request) + "\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        for entry in get_status(url).get("rollbacks", []):
            if entry.get("id") == rid:
                return dict(entry)
    (run_dir / REQUEST).unlink(missing_ok=True)
    raise TimeoutError(
        f"the server did not take the rollback in {timeout:.0f} s (it takes requests every serve.poll_s, after "
        f"a learner step in flight); the request was withdrawn"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m draft_opd_ray.serve.rollback",
        description="Make a running `python -m draft_opd_ray.serve` serve a draft version it published earlier.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the server's run dir")
    p.add_argument(
        "version", metavar="VERSION", type=int, help="a published version (0: the draft it started with)"
    )
    p.add_argument(
        "--freeze", action="store_true", help="stop learning too (default: the learner restarts from it)"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the server (default 600)"
    )
    a = p.parse_args(argv)
    try:
        done = ask(a.run_dir, a.version, a.freeze, a.timeout)
    except RollbackError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if done.get("already"):
        print(f"the server already serves version {a.version}: nothing to do")
        return 0
    if done["error"]:
        print(f"error: rollback to version {a.version} failed: {done['error']}", file=sys.stderr)
        return 1
    print(
        f"version {done['to']} serves again (was {done['from']}; refit {done['refit_s']:.2f} s, proved); "
        + ("learning stopped (--freeze)" if a.freeze else done.get("learner", "the learner goes on from it"))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
