"""Entry point: `python -m draft_opd_ray.main [+cluster=NAME] [key=value ...]`.

Composes the Hydra config, validates it (typed nodes, cross-field checks, placement), then either prints
the placement plan (`dry_run=true`, no Ray, no model) or runs the requested stages in Hydra's run dir.
Config and data errors exit with code 2 and one line naming the key; nothing heavy has started by then. So do
cluster errors (an unreachable head, a plan the live nodes cannot hold, storage some node does not see): the
driver reaches Ray before the first stage loads a model.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from draft_opd_ray.config.schema import Config
from draft_opd_ray.config.store import register_configs, to_config
from draft_opd_ray.config.validate import check_run_dir, validate
from draft_opd_ray.errors import DraftOPDError
from draft_opd_ray.placement import PlacementPlan

EXIT_BAD_INPUT = 2


def describe(cfg: Config, plan: PlacementPlan) -> str:
    d = cfg.draft
    head = [
        f"stages: {', '.join(cfg.stages)}",
        f"target: {cfg.target.path} ({cfg.target.dtype}, max_model_len {cfg.target.max_model_len})",
        f"draft:  {d.kind} (K={d.num_speculative_tokens}){' from ' + d.path if d.path else ''}",
        f"objective: {cfg.loss.objective}, directions {cfg.loss.directions}, gamma {cfg.loss.gamma}, "
        f"estimator {cfg.loss.estimator}; anchors: {cfg.anchor.policy}; async max_staleness "
        f"{cfg.async_.max_staleness}",
    ]
    return "\n".join(head) + "\n" + plan.render()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def _hydra_main(dcfg: DictConfig) -> None:
    try:
        cfg = to_config(dcfg)
        plan = validate(cfg)
    except (DraftOPDError, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    print(describe(cfg, plan), flush=True)
    if cfg.dry_run:
        return
    from hydra.core.hydra_config import HydraConfig

    from draft_opd_ray.driver import run

    run_dir = HydraConfig.get().runtime.output_dir
    try:
        check_run_dir(cfg, run_dir)
        run(cfg, plan, run_dir=run_dir)
    except DraftOPDError as e:  # bad input found once the target is resolved or the cluster is reached
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def main() -> None:
    register_configs()
    _hydra_main()


if __name__ == "__main__":
    main()
