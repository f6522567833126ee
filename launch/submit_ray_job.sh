#!/usr/bin/env bash
# Submit a run to a running Ray cluster as a Ray job. The job runs the same command as a local run.
#   RAY_ADDRESS=http://head:8265 launch/submit_ray_job.sh +cluster=8xA100 target.path=/models/Qwen3-8B
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RAY_ADDRESS:?set RAY_ADDRESS to the Ray dashboard address, e.g. http://head:8265}"
ray job submit --address "$RAY_ADDRESS" --working-dir . \
  --runtime-env-json '{"excludes": ["outputs", "multirun", ".git", "wandb"]}' \
  -- python -m draft_opd_ray.main "$@"
