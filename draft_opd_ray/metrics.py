"""Run metrics: one JSON object per line in `<run_dir>/metrics.jsonl` (always) and wandb (offline by default).

Every line has `stage`, `step` and `time` (seconds since the logger started) plus the step's metrics.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


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
            f.write(json.dumps(row, default=float) + "\n")
        if self._wandb is not None:
            nums = {f"{stage}/{k}": v for k, v in metrics.items() if isinstance(v, int | float)}
            self._wandb.log(nums)
        return row

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
