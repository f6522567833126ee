"""Entry point: `python -m draft_opd_ray.main [+cluster=NAME] [key=value ...]`.

Composes the Hydra config, validates it (typed nodes, cross-field checks, placement), then either prints
the placement plan (`dry_run=true`, no Ray, no model) or runs the requested stages in Hydra's run dir.
Config and data errors exit with code 2 and one line naming the key; nothing heavy has started by then. So do
cluster errors (an unreachable head, a plan the live nodes cannot hold, storage some node does not see): the
driver reaches Ray before the first stage loads a model.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TextIO

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from draft_opd_ray.checkpoint import real_path
from draft_opd_ray.config.schema import Config
from draft_opd_ray.config.store import override_key_error, register_configs, resumed_config, to_config
from draft_opd_ray.errors import DraftOPDError, RunError
from draft_opd_ray.placement import PlacementPlan
from draft_opd_ray.preflight import check_resumable, check_run_dir, size, validate
from draft_opd_ray.sizing import Derived

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def describe(cfg: Config, plan: PlacementPlan, sized: list[Derived] | None = None) -> str:
    """What the run will do, before it starts: stages, models, objective, the teacher's source, what was sized
    from the target's files (``sized``: `preflight.size`) and the placement plan."""
    d = cfg.draft
    head = [
        f"stages: {', '.join(cfg.stages)}",
        f"target: {cfg.target.path} ({cfg.target.dtype}, max_model_len {cfg.target.max_model_len})",
        f"draft:  {d.kind} (K={d.num_speculative_tokens}){' from ' + d.path if d.path else ''}",
        f"objective: {cfg.loss.objective}, directions {cfg.loss.directions}, gamma {cfg.loss.gamma}, "
        f"estimator {cfg.loss.estimator}; anchors: {cfg.anchor.policy}; async max_staleness "
        f"{cfg.async_.max_staleness}",
    ]
    if "opd" in cfg.stages:
        from draft_opd_ray.drafts.registry import draft_kind
        from draft_opd_ray.opd.source import describe_source

        k = draft_kind(d.kind)
        head.append(
            describe_source(
                cfg.teacher, cfg.loss, cfg.replay, d.kind, k.features_from_drafter, k.feature_conditioned
            )
        )
    if sized:
        from draft_opd_ray.sizing import render

        head.append(render(sized))
    return "\n".join(head) + "\n" + plan.render()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def _hydra_main(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    if _TAP is not None and not _TAP.passing:
        _TAP.release()

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        if dcfg.get("resume") not in (None, ""):
            dcfg = resumed_config(dcfg.resume, list(hc.overrides.task))
            check_resumable(Path(dcfg.resume), run_dir)
        cfg = to_config(dcfg)
        # `.../latest/draft` as the step it names now, for every check, actor and vLLM engine of the run
        if cfg.draft.path is not None:
            cfg.draft.path = real_path(cfg.draft.path)
        sized = size(cfg)
        plan = validate(cfg)
        if _ENTRY is not None:
            _ENTRY.check(cfg)
    except (DraftOPDError, OmegaConfBaseException) as e:
        if str(hc.output_subdir).startswith(
            ".hydra/resume-"
        ):  # a refused resume leaves the run dir as it was
            import shutil

            shutil.rmtree(run_dir / str(hc.output_subdir), ignore_errors=True)
            with contextlib.suppress(OSError):  # what Hydra made in a dir that is no run dir (if still empty)
                (run_dir / ".hydra").rmdir()
            log_file = run_dir / "main.log"
            if log_file.is_file() and log_file.stat().st_size == 0:
                log_file.unlink()
            _stop(e, EXIT_BAD_INPUT, None)
        _stop(e, EXIT_BAD_INPUT, run_dir)
    print(describe(cfg, plan, sized) if _ENTRY is None else _ENTRY.describe(cfg, sized), flush=True)
    if cfg.dry_run:
        remove_untouched_run_dir(run_dir)
        if str(hc.mode) == "RunMode.MULTIRUN":  # the sweep dir, where Hydra wrote multirun.yaml at start
            remove_untouched_sweep_dir(Path(hc.sweep.dir))
        return
    from draft_opd_ray.logs import quiet, summary

    quiet(run_dir, cfg.verbose, cpu_only=plan.gpus_used() == 0)  # before anything imports vLLM
    from draft_opd_ray.driver import run

    try:
        check_run_dir(cfg, run_dir)
        if _ENTRY is not None:
            _ENTRY.run(cfg, str(run_dir))  # a server: until Ctrl-C or SIGTERM, which it takes to stop cleanly
            raise KeyboardInterrupt
        run(cfg, plan, run_dir=str(run_dir))
        if (line := summary()) is not None:
            print(f"  {line}", flush=True)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`ray job stop`): Ray is shut down by now
        _stop(interrupted(run_dir), EXIT_INTERRUPTED, run_dir, prefix="interrupted")
    except Exception as e:  # noqa: BLE001 - user errors and run failures become one line; the rest propagates
        cause = user_facing(e)
        if cause is None:
            raise
        _stop(cause, EXIT_BAD_INPUT if isinstance(cause, DraftOPDError) else EXIT_RUN_FAILED, run_dir)


def user_facing(e: BaseException) -> DraftOPDError | RunError | None:
    """The user error or run failure behind ``e``: itself, or the cause of a Ray task or actor error (raised
    inside an actor), or of an exception chained from one; None for a bug (its traceback is what helps)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (DraftOPDError, RunError)):
            return x
        stack += [getattr(x, "cause", None), x.__cause__, x.__context__]
    return None


def interrupted(run_dir: Path) -> str:
    """What an interrupted run keeps: its last complete checkpoint and how to continue from it, or that there is
    none (a run stopped before its first checkpoint starts again from the beginning)."""
    from draft_opd_ray.checkpoint import latest_checkpoint

    if _ENTRY is not None:
        return _ENTRY.stopped(run_dir)

    kept = [
        f"checkpoints/{stage}/{last.name}"
        for stage in ("sft", "opd")
        if (last := latest_checkpoint(run_dir / "checkpoints" / stage, "training_state.pt")) is not None
    ]
    if not kept:
        return "no checkpoint was written yet; run the same command again to start over"
    return f"the last complete checkpoint ({kept[-1]}) is kept: resume={run_dir} continues from it"


def _raise_interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def _stop(e: BaseException | str, code: int, run_dir: Path | None, prefix: str = "error") -> NoReturn:
    """One line on stderr, ``run_dir`` gone if Hydra's files are all it holds, exit ``code``."""
    print(f"{prefix}: {e}", file=sys.stderr, flush=True)
    if run_dir is not None:
        remove_untouched_run_dir(run_dir)
    sys.exit(code)


# what Hydra writes at start, and the libraries' log folder a quiet run opens before its first stage (logs.py)
HYDRA_FILES = {".hydra", "main.log", "logs"}


def remove_untouched_run_dir(run_dir: Path) -> bool:
    """Remove a run dir that holds only what Hydra wrote at start (a dry run, a rejected config), and the empty
    date folder of Hydra's default `outputs/<date>/<time>` above it. Returns whether it was removed."""
    import shutil

    if not run_dir.is_dir() or not {p.name for p in run_dir.iterdir()} <= HYDRA_FILES:
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = run_dir.parent
    if parent.parent.name == "outputs" and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        with contextlib.suppress(OSError):
            parent.parent.rmdir()  # `outputs/` itself, if that was all it held
    return True


def remove_untouched_sweep_dir(sweep_dir: Path) -> bool:
    """Remove a sweep dir that holds nothing but Hydra's `multirun.yaml` (a dry-run sweep: each job removes its own
    dir, and the last one leaves nothing), and the empty date folder of Hydra's default `multirun/<date>/<time>`."""
    import shutil

    if not sweep_dir.is_dir() or not {p.name for p in sweep_dir.iterdir()} <= {"multirun.yaml"}:
        return False
    shutil.rmtree(sweep_dir, ignore_errors=True)
    parent = sweep_dir.parent
    if parent.parent.name == "multirun" and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        with contextlib.suppress(OSError):
            parent.parent.rmdir()  # `multirun/` itself, if that was all it held
    return True


class _HeldStderr(io.TextIOBase):
    """stderr held back until the task starts: what Hydra writes before that is a composition error (a typo in a
    key, a value of the wrong type), which `main` turns into one line. From the task on, writes pass through."""

    def __init__(self, real: TextIO) -> None:
        self.real, self.passing = real, False
        self.held: list[str] = []

    def write(self, s: str) -> int:
        if self.passing:
            return self.real.write(s)
        self.held.append(s)
        return len(s)

    def flush(self) -> None:
        self.real.flush()

    def fileno(self) -> int:
        return self.real.fileno()

    def isatty(self) -> bool:
        return self.real.isatty()

    def release(self) -> None:
        self.passing = True
        self.real.write("".join(self.held))
        self.held = []


_TAP: _HeldStderr | None = None


@dataclass(frozen=True)
class Entry:
    """Another command on the same config tree, overrides and checks (`python -m draft_opd_ray.serve`): its own
    check after validation (before Hydra's run dir is used), its dry-run description, what it runs (until
    interrupted) and its closing line."""

    check: Callable[[Config], None]
    describe: Callable[[Config, list[Derived] | None], str]
    run: Callable[[Config, str], None]
    stopped: Callable[[Path], str]


_ENTRY: Entry | None = None  # None: the stages (`run`)


def composition_error(text: str) -> str:
    """Hydra's multi-line composition error as one line that starts with the key (its `full_key`), or the group
    and its options for a group option that does not exist."""
    if "Could not find" in text and "Available options in" in text:
        missing = next(x.strip() for x in text.splitlines() if "Could not find" in x)
        missing = missing.split("Could not find", 1)[1].strip()
        group = text.split("Available options in", 1)[1].split(":", 1)[0].strip().strip("'")
        options = (
            text.split("Available options in", 1)[1].split(":", 1)[1].split("Config search path")[0].split()
        )
        return f"{group}: Could not find {missing}; the options are {', '.join(options)}"
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    lines = [x for x in lines if not x.startswith("Set the environment variable HYDRA_FULL_ERROR")]
    key = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("full_key:")), None)
    detail = [x for x in lines if not x.startswith(("full_key:", "object_type=", "reference_type="))]
    if not detail:
        return "the command line could not be composed into a config"
    head, rest = detail[-1], detail[:-1]
    msg = f"{head} ({'; '.join(rest)})" if rest else head
    return f"{key}: {msg}" if key else msg


def main(entry: Entry | None = None) -> None:
    """``entry``: None for the stages, else another command on the same config (`serve/__main__.py`)."""
    global _TAP, _ENTRY
    import signal

    _ENTRY = entry

    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # SIGTERM stops a run as Ctrl-C does
        signal.signal(signal.SIGTERM, _raise_interrupt)
    register_configs()
    bad = override_key_error(sys.argv[1:])
    if bad is not None:  # before Hydra: a typo leaves no run dir
        print(f"error: {bad}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    _TAP = tap = _HeldStderr(sys.stderr)
    sys.stderr = tap
    try:
        _hydra_main()
    except SystemExit as e:
        if not tap.passing and e.code not in (0, None):  # Hydra refused the command line
            sys.stderr, text = tap.real, "".join(tap.held)
            tap.held, tap.passing = [], True
            print(f"error: {composition_error(text)}", file=sys.stderr, flush=True)
            sys.exit(EXIT_BAD_INPUT)
        raise
    finally:
        if not tap.passing:
            tap.release()  # --help, --cfg and the like: what Hydra held back
        sys.stderr = tap.real


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":
    # A process that multiprocessing spawned from a run (a vLLM engine core of the driver's) imports the parent's
    # main module under this name before its target: route its libraries there, before vLLM's import-time warnings
    # (vLLM configures logging only once its engine starts). A no-op unless the run is quiet.
    from draft_opd_ray.logs import route

    route("driver")
