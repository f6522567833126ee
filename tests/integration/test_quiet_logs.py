"""Quiet console versus ``verbose=true`` (`draft_opd_ray/logs.py`), with vLLM's own logging set-up: in a quiet run
vLLM's INFO lines and warnings go to `logs/<role>.log` and only its errors reach the console, in the routed process
(configured as `vllm.LLM` configures it, from `EngineArgs.create_logging_config`) and in a process it spawns that
configures vLLM's logging afresh from the environment (an engine core); a verbose run leaves vLLM as it is. Ray's workers get the same through `runtime_env` (checked here as the job-level dict Ray receives)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from draft_opd_ray import logs
from tests import helpers

pytestmark = [pytest.mark.vllm]

# an engine core's view: a fresh interpreter that imports vLLM and logs, with no routing of its own
CHILD = textwrap.dedent(
    """
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging, init_logger
    configure_logging(LoggingConfig())  # what an engine core does with the config its parent made
    log = init_logger("vllm.quiet_test_child")
    log.info("INFO-LINE child"); log.warning("WARN-LINE child"); log.error("ERROR-LINE child")
    """
)
# the routed process: logs three lines with vLLM's logger, then spawns the child
PARENT = textwrap.dedent(
    """
    import subprocess, sys
    from draft_opd_ray import logs
    logs.route("driver")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.logger import configure_logging_if_needed, init_logger
    configure_logging_if_needed(EngineArgs().create_logging_config())  # what vllm.LLM does first
    log = init_logger("vllm.quiet_test")
    log.info("INFO-LINE parent"); log.warning("WARN-LINE parent"); log.error("ERROR-LINE parent")
    subprocess.run([sys.executable, sys.argv[1]], check=True)
    """
)


def _run(tmp_path: Path, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "parent.py").write_text(PARENT)
    (tmp_path / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_LOGGING", "DRAFT_OPD_RAY_LOG"))}
    env |= {"PYTHONPATH": str(helpers.REPO), **env_extra}
    return subprocess.run(
        [sys.executable, str(tmp_path / "parent.py"), str(tmp_path / "child.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_quiet_run_sends_vllm_lines_to_the_log_and_keeps_errors_on_the_console(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = _run(tmp_path, logs.run_env(run_dir, verbose=False, cpu_only=True))
    assert r.returncode == 0, r.stderr
    console = r.stdout + r.stderr
    for who in ("parent", "child"):
        assert f"ERROR-LINE {who}" in console
        assert f"INFO-LINE {who}" not in console and f"WARN-LINE {who}" not in console, console
    log = (run_dir / "logs" / "driver.log").read_text()
    for who in ("parent", "child"):
        for level in ("INFO", "WARN", "ERROR"):
            assert f"{level}-LINE {who}" in log, log


def test_verbose_run_leaves_vllm_as_it_is(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = logs.run_env(run_dir, verbose=True, cpu_only=True)
    assert env == {}
    r = _run(tmp_path, env)
    assert r.returncode == 0, r.stderr
    console = r.stdout + r.stderr
    for who in ("parent", "child"):
        for level in ("INFO", "WARN", "ERROR"):
            assert f"{level}-LINE {who}" in console, console
    assert not (run_dir / "logs").exists()


def test_ray_workers_get_the_quiet_environment_and_the_hook(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(logs.LOG_DIR_ENV, raising=False)
    assert logs.runtime_env() == {}  # verbose: Ray as it is
    for k, v in logs.run_env(tmp_path, verbose=False, cpu_only=True).items():
        monkeypatch.setenv(k, v)
    env = logs.runtime_env()
    assert env["worker_process_setup_hook"] == "draft_opd_ray.logs.worker_hook"
    assert env["env_vars"] == {logs.LOG_DIR_ENV: str(tmp_path.resolve() / "logs"), "DS_ACCELERATOR": "cpu"}
    assert not logs.tqdm_on_load()
