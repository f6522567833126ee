#!/usr/bin/env bash
# Hydra multirun sweep over gamma and anchor policy; each run gets its own directory under multirun/.
#   launch/sweep.sh +cluster=8xA100
set -euo pipefail
cd "$(dirname "$0")/.."
python -m draft_opd_ray.main -m loss.gamma=0.6,0.8,0.9 anchor.policy=error,all "$@"
