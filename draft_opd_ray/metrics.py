"""Run metrics: one JSON object per line in `<run_dir>/metrics.jsonl` (always) and wandb (offline by default).

Every line has `stage`, `step` and `time` (seconds since the logger started) plus the step's metrics. Lines are
strict JSON (a NaN or infinite value is written as null); `read_metrics` skips a torn last line (a run killed
mid-write) and names any other line that does not parse.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from draft_opd_ray.errors import DataError


def finite(v: Any) -> Any:
    """``v`` with every NaN or infinite float (in nested dicts and lists too) replaced by None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [finite(x) for x in v]
    return v


def json_line(row: dict[str, Any]) -> str:
    """One strict-JSON line (no NaN/Infinity tokens: they become null), newline-terminated."""
    return json.dumps(finite(json.loads(json.dumps(row, default=float))), allow_nan=False) + "\n"


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        wandb_mode: str = "offline",
        project: str = "draft_opd_ray",
        entity: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        self._wandb: Any = None
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                mode=wandb_mode,  # type: ignore[arg-type]
                project=project,
                entity=entity,
                dir=str(run_dir),
                config=config or {},
                reinit="finish_previous",
            )

    def log(self, stage: str, step: int, **metrics: Any) -> dict[str, Any]:
        row = {"stage": stage, "step": int(step), "time": round(time.time() - self.t0, 3), **metrics}
        with self.path.open("a") as f:
            f.write(json_line(row))
        if self._wandb is not None:
            nums = {f"{stage}/{k}": v for k, v in metrics.items() if isinstance(v, int | float)}
            self._wandb.log(nums)
        return row

    def elapsed(self) -> float:
        """Seconds on the run's clock (the `time` of the next row)."""
        return time.time() - self.t0

    def resume(self, stage: str, step: int) -> int:
        """A resume from ``stage``'s checkpoint at ``step``: drop that stage's rows after it (they were logged after
        the checkpoint, and are logged again), and continue the clock from the last row kept. Returns the rows
        dropped."""
        from draft_opd_ray.checkpoint import write_text_atomic

        if not self.path.is_file():
            return 0
        rows = read_metrics(self.path)
        keep = [r for r in rows if not (r.get("stage") == stage and int(r.get("step", 0)) > step)]
        write_text_atomic(self.path, "".join(json_line(r) for r in keep))
        if keep:
            self.t0 = time.time() - float(keep[-1].get("time") or 0.0)
        return len(rows) - len(keep)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a torn last line is skipped, any other bad line is a `DataError`."""
    text = Path(path).read_text()
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1 and not text.endswith("\n"):
                break  # torn: the writer was killed mid-line
            raise DataError(f"{path}: line {i + 1} is not JSON ({e.msg})") from None
    return rows
