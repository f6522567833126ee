"""The acceptance regime of a run's rollouts: whether the objective's ablations can differ there at all.

With K drafted tokens a block that accepts a of them has the accepted set A = {1..a} plus the correction position
a+1 and the rejected set R = {a+1..K'} (docs/design.md, "Objective"). Where most blocks accept nothing, A is the
correction position alone, so Draft-OPD (forward KL on A, reverse KL on R), forward-only and reverse-only differ
in little but the KL's direction at one position (C3); and where nearly every block has a rejection, the `error`
anchor policy picks nearly every block start, as `all` does (C4's contrast with `random` is then mostly "block
starts or not"). This module measures both from the anchor records:

    python -m draft_opd_ray.eval.regime RUN_DIR [--out results/<study>/regime_<arm>.json]

Imports only the standard library and the records' reader.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draft_opd_ray.rollout.records import read_parquet
from draft_opd_ray.wire import RequestRecord


def regime(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Counts over every verification step (block) of ``records``:

    blocks                      verification steps
    share_with_rejection        blocks with accepted < drafted (a rejection inside the block)
    mean_accepted               mean accepted drafted tokens per block (tau - 1)
    share_accepting_none        blocks with a = 0: A is the correction position alone
    mean_forward_positions      mean |A| per block (a, plus the correction position where a < K')
    mean_rejected_positions     mean |R| per block under `rejected_scope=all` (K' - a)
    error_anchors_per_block_start  `anchor.policy=error` anchors / `all` anchors (= share_with_rejection)
    accepted_histogram          blocks by a = 0..K
    """
    blocks = rejected = none = 0
    acc_sum = fwd_sum = rej_sum = 0
    hist: dict[int, int] = {}
    k_max = 0
    for r in records:
        for a, d in zip(r.accepted, r.drafted):
            n = len(d)
            k_max = max(k_max, n)
            blocks += 1
            acc_sum += a
            hist[a] = hist.get(a, 0) + 1
            rejected += a < n
            none += a == 0
            fwd_sum += a + (1 if a < n else 0)
            rej_sum += n - a
    per = 1 / blocks if blocks else float("nan")
    return {
        "blocks": blocks,
        "k": k_max,
        "share_with_rejection": rejected * per,
        "mean_accepted": acc_sum * per,
        "share_accepting_none": none * per,
        "mean_forward_positions": fwd_sum * per,
        "mean_rejected_positions": rej_sum * per,
        "error_anchors_per_block_start": rejected * per,
        "accepted_histogram": [hist.get(a, 0) for a in range(k_max + 1)],
    }


def run_regime(run_dir: Path) -> dict[str, Any]:
    """`regime` of every anchor record a run wrote (`anchors/*.parquet`), with the run it came from."""
    files = sorted((run_dir / "anchors").glob("*.parquet"))
    if not files:
        raise SystemExit(f"error: {run_dir}: no anchors/*.parquet (not a Draft-OPD run dir?)")
    records = [r for f in files for r in read_parquet(f)]
    return {"run": run_dir.name, "records": len(records), **regime(records)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="also write the numbers here (JSON)")
    args = ap.parse_args(argv)
    out = run_regime(args.run_dir)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
