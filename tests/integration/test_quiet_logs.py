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

# an engine core's view: a fresh interpreter that imports vLLM and logs, with no routing of its own; and runs
# vLLM's CPU op that binds memory, which warns from C++ (torch's TORCH_WARN, straight to stderr)
CHILD = textwrap.dedent(
    """
    import torch
    from vllm.platforms import current_platform
    current_platform.import_kernels()
    torch.ops._C.init_cpu_memory_env([0])  # C++: "Warning: NUMA binding: ..."
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging, init_logger
    configure_logging(LoggingConfig())  # what an engine core does with the config its parent made
    log = init_logger("vllm.quiet_test_child")
    log.info("INFO-LINE child"); log.warning("WARN-LINE child"); log.error("ERROR-LINE child")
    """
)
# the routed process: logs three lines with vLLM's logger, a warning with transformers' and prints one line as
# DeepSpeed does at init (inside `into_log`), then spawns the child
PARENT = textwrap.dedent(
    """
    import subprocess, sys
    from draft_opd_ray import logs
    logs.route("driver")
    from transformers.utils import logging as hf_logging
    hf_logging.get_logger("transformers.quiet_test").warning("HF-WARN-LINE parent")
    with logs.into_log():
        print("PRINTED-LINE parent")
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
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_LOGGING", "DRAFT_OPD_RAY_LOG", "TORCH_CPP_LOG"))
    }
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
    assert "PRINTED-LINE" not in console and "NUMA binding" not in console, console
    log = (run_dir / "logs" / "driver.log").read_text()
    for who in ("parent", "child"):
        for level in ("INFO", "WARN", "ERROR"):
            assert f"{level}-LINE {who}" in log, log
    assert "HF-WARN-LINE parent" in log and "PRINTED-LINE parent" in log, log


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
    assert "HF-WARN-LINE parent" in console and "PRINTED-LINE parent" in console, console
    assert "NUMA binding" in console, console  # the C++ warning, as torch prints it
    assert not (run_dir / "logs").exists()


def test_ray_workers_get_the_quiet_environment_and_the_hook(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(logs.LOG_DIR_ENV, raising=False)
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    assert logs.runtime_env() == {}  # verbose: Ray as it is
    for k, v in logs.run_env(tmp_path, verbose=False, cpu_only=True).items():
        monkeypatch.setenv(k, v)
    env = logs.runtime_env()
    assert env["worker_process_setup_hook"] == "draft_opd_ray.logs.worker_hook"
    assert env["env_vars"] == {
        logs.LOG_DIR_ENV: str(tmp_path.resolve() / "logs"),
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "DS_ACCELERATOR": "cpu",
    }
    assert not logs.tqdm_on_load()


# what multiprocessing's spawn does in a child of `python -m draft_opd_ray.main` (`_fixup_main_from_name`): the
# parent's main module under the name `__mp_main__`, then the target, whose vLLM imports log before any config
SPAWNED = textwrap.dedent(
    """
    import runpy
    runpy.run_module("draft_opd_ray.main", run_name="__mp_main__", alter_sys=True)
    from vllm.logger import init_logger
    init_logger("vllm.quiet_test_import").warning("IMPORT-TIME-LINE")
    """
)


@pytest.mark.parametrize("verbose", [False, True])
def test_a_process_spawned_from_the_driver_logs_its_import_time_lines(tmp_path: Path, verbose: bool) -> None:
    run_dir = tmp_path / "run"
    (tmp_path / "spawned.py").write_text(SPAWNED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_LOGGING", "DRAFT_OPD_RAY_LOG"))}
    env |= {"PYTHONPATH": str(helpers.REPO), **logs.run_env(run_dir, verbose=verbose, cpu_only=True)}
    r = subprocess.run(
        [sys.executable, str(tmp_path / "spawned.py")], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    if verbose:  # Python's last resort, as vLLM leaves it
        assert "IMPORT-TIME-LINE" in r.stderr
        assert not (run_dir / "logs").exists()
    else:
        assert "IMPORT-TIME-LINE" not in r.stdout + r.stderr
        assert "IMPORT-TIME-LINE" in (run_dir / "logs" / "driver.log").read_text()


# a quiet driver with Ray: a worker's child prints a line of `CONSOLE_NOISE` and one of its own to stderr
RAY_DRIVER = textwrap.dedent(
    """
    import sys, time
    from draft_opd_ray import logs
    logs.quiet(sys.argv[1], verbose=sys.argv[2] == "1", cpu_only=True)
    import ray
    ray.init(num_cpus=1, include_dashboard=False)

    @ray.remote
    def child_prints():
        import subprocess
        code = (
            "import sys; print(\\"Triton is installed, but doesn't include CPU backend. Disabling Triton.\\", "
            "file=sys.stderr); print('KEPT-LINE', file=sys.stderr)"
        )
        subprocess.run([sys.executable, "-c", code], check=True)

    ray.get(child_prints.remote())
    time.sleep(3)  # Ray streams a worker's lines to the driver every second or so
    ray.shutdown()
    """
)


@pytest.mark.parametrize("verbose", [False, True])
def test_the_drivers_console_drops_known_library_noise_from_workers(tmp_path: Path, verbose: bool) -> None:
    (tmp_path / "driver.py").write_text(RAY_DRIVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRAFT_OPD_RAY_LOG", "RAY_DEDUP"))}
    env |= {"PYTHONPATH": str(helpers.REPO)}
    r = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "run"), "1" if verbose else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    console = r.stdout + r.stderr
    assert "KEPT-LINE" in console, console
    assert ("Triton is installed" in console) == verbose, console
