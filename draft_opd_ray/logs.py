"""Quiet by default: the libraries' log lines go to `logs/` in the run dir, the console keeps the run's own.

With ``verbose=false`` (the default), the INFO lines and warnings of vLLM, Ray, DeepSpeed and transformers go to
`logs/driver.log` (the driver, the engines it runs itself and their engine-core processes) and `logs/workers.log`
(every Ray worker and the engines it runs); only their errors reach the console too. The console keeps the run's
stage lines, progress bars, warnings and errors. ``verbose=true`` leaves every library as it is.

How every process is reached, with no vLLM file touched:
- the driver calls `quiet` before it imports vLLM; Ray's workers run `worker_hook` at start (Ray's
  ``worker_process_setup_hook``, set by `runtime_env`), which reads `LOG_DIR_ENV`;
- each then points ``VLLM_LOGGING_CONFIG_PATH`` at a logging config of its own (vLLM's documented way to
  configure its logging), which the engine-core processes it spawns inherit and apply at import;
- vLLM's weight-loading progress bars are off (`tqdm_on_load`); Python's FutureWarnings from the libraries are
  dropped in the child processes (``PYTHONWARNINGS``); DeepSpeed is told its accelerator on a CPU run
  (``DS_ACCELERATOR=cpu``), which answers the one warning it prints at import;
- transformers' own console handler is removed, so its warnings (e.g. a tokenizer's "sequence length is longer
  than the specified maximum") reach the log file through the same config; what a library prints rather than
  logs goes there inside `into_log` (DeepSpeed's "op built successfully" at `init_distributed`);
- a process that vLLM spawns logs at import, before it configures logging from the engine's config, so a warning
  of that moment has no handler but Python's last resort (stderr, unformatted). The driver's spawned processes
  import `draft_opd_ray.main` first (multiprocessing re-imports the parent's main module) and are routed there;
  a Ray worker's re-import Ray's own, so the driver's console drops those lines from workers
  (`CONSOLE_NOISE`, Ray's documented ``RAY_DEDUP_LOGS_SKIP_REGEX``; they stay in Ray's worker logs);
- warnings that C++ code writes straight to stderr (torch's ``TORCH_WARN``, e.g. vLLM's CPU worker on NUMA
  binding) are not logging records: a quiet run sets ``TORCH_CPP_LOG_LEVEL=ERROR`` (unless it is set), so only
  their errors print; ``verbose=true`` shows them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.config
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LOG_DIR_ENV = "DRAFT_OPD_RAY_LOG_DIR"  # set: quiet, the libraries log under this dir
LIBRARIES = ("vllm", "ray", "DeepSpeed", "transformers", "torch", "accelerate", "filelock", "urllib3")
_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
# Lines a library prints in a Ray worker's child before any logging config applies (vLLM's engine cores at
# import): a quiet run's driver keeps them off its console.
CONSOLE_NOISE = (r"Triton is installed, but doesn't include CPU backend",)
# the environment `run_env` sets, which `runtime_env` carries to every worker
_RUN_ENV_KEYS = (LOG_DIR_ENV, "TORCH_CPP_LOG_LEVEL", "DS_ACCELERATOR")
_routed: Path | None = None  # this process's library log, once `route` has run in a quiet run


def logging_config(log_file: Path) -> dict[str, Any]:
    """A `logging.config.dictConfig` that sends the libraries' loggers to ``log_file`` (INFO and up) and their
    errors to stderr as well; the run's own loggers and the root are left alone."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": _FORMAT}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "filename": str(log_file),
                "mode": "a",
                "formatter": "plain",
                "level": "INFO",
            },
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "ERROR"},
        },
        "loggers": {
            name: {"handlers": ["file", "console"], "level": "INFO", "propagate": False} for name in LIBRARIES
        },
    }


def run_env(run_dir: str | os.PathLike[str], verbose: bool, cpu_only: bool) -> dict[str, str]:
    """The environment every process of a quiet run gets (empty when ``verbose``)."""
    if verbose:
        return {}
    env = {
        LOG_DIR_ENV: str(Path(run_dir).resolve() / "logs"),
        "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
    }
    if cpu_only:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def route(role: str) -> Path | None:
    """In this process, when `LOG_DIR_ENV` is set: the libraries' loggers to ``logs/<role>.log``, and the
    environment the processes it spawns inherit (vLLM's logging config, no library FutureWarnings). Returns the
    log file, or None when the run is verbose."""
    d = os.environ.get(LOG_DIR_ENV)
    if not d:
        return None
    logs = Path(d)
    logs.mkdir(parents=True, exist_ok=True)
    log_file = logs / f"{role}.log"
    config = logging_config(log_file)
    # per process: a worker on another node writes its own
    conf = logs / f".{role}-logging-{os.getpid()}.json"
    conf.write_text(json.dumps(config))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(conf)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    logging.config.dictConfig(config)
    _drop_transformers_handler()
    global _routed
    _routed = log_file
    return log_file


def _drop_transformers_handler() -> None:
    """transformers adds a stderr handler of its own to its library logger at first use, beside any configured
    one: add it now (if transformers is installed) and take it off, so the dictConfig's handlers are the only
    ones."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()


@contextlib.contextmanager
def into_log() -> Iterator[None]:
    """Inside: what this process prints to stdout goes to its library log in a quiet run, for a library that
    prints rather than logs; as it is otherwise."""
    if _routed is None:
        yield
        return
    with _routed.open("a") as out, contextlib.redirect_stdout(out):
        yield


def quiet(run_dir: str | os.PathLike[str], verbose: bool, cpu_only: bool) -> Path | None:
    """The driver's part: set the run's environment here (Ray's local workers inherit it; `runtime_env` carries it
    to a joined cluster), keep `CONSOLE_NOISE` off the console (read when Ray is imported, which is later; a
    user's own ``RAY_DEDUP_LOGS_SKIP_REGEX`` wins) and route this process. Returns the driver's log file (None:
    verbose)."""
    os.environ.update(run_env(run_dir, verbose, cpu_only))
    if not verbose:
        os.environ.setdefault("RAY_DEDUP_LOGS_SKIP_REGEX", "|".join(CONSOLE_NOISE))
    return route("driver")


def runtime_env() -> dict[str, Any]:
    """Ray's job-level `runtime_env` for this process's run: in a quiet run, its environment and `worker_hook` in
    every worker; else nothing."""
    if not os.environ.get(LOG_DIR_ENV):
        return {}
    env = {k: os.environ[k] for k in _RUN_ENV_KEYS if k in os.environ}
    return {"env_vars": env, "worker_process_setup_hook": "draft_opd_ray.logs.worker_hook"}


def worker_hook() -> None:
    """Ray's ``worker_process_setup_hook``: route a worker before any actor imports vLLM."""
    route("workers")


def tqdm_on_load() -> bool:
    """Whether vLLM shows its weight-loading progress bars: in verbose runs only."""
    return not os.environ.get(LOG_DIR_ENV)


def summary() -> str | None:
    """One line for the end of a quiet run: where the libraries' lines went and how many warnings they hold."""
    d = os.environ.get(LOG_DIR_ENV)
    if not d or not Path(d).is_dir():
        return None
    files = sorted(Path(d).glob("*.log"))
    warnings = sum(
        1 for f in files for line in f.read_text(errors="replace").splitlines() if " WARNING " in line
    )
    return f"library logs: {d} ({', '.join(f.name for f in files)}; {warnings} warning line(s); verbose=true shows them)"
