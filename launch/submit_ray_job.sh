#!/usr/bin/env bash
# Submit a run to a running Ray cluster as a Ray job, follow its log, and exit 0 only when the job SUCCEEDED.
#   RAY_ADDRESS=http://head:8265 launch/submit_ray_job.sh +cluster=2x8xH100 target.path=/models/Qwen3-8B
#   RAY_ADDRESS=http://127.0.0.1:8275 launch/submit_ray_job.sh +cluster=cpu_2node stages=[eval] draft.path=...
# RAY_ADDRESS is the dashboard (job server) address. The job's working dir is this repo without run outputs,
# caches and git; inside the job Ray points RAY_ADDRESS at the cluster, so the run joins it. A job's working dir
# is temporary, so the run dir is <cluster.storage_dir>/jobs/<submission id> (the storage dir the overrides
# resolve to) unless the overrides give hydra.run.dir themselves.
# Settings (environment): SUBMISSION_ID (default draft-opd-<time>), ENTRYPOINT_NUM_CPUS (the driver's CPUs,
# default 0.1), NO_FOLLOW=1 (submit and return; follow later with `ray job logs -f ID`).
# DRAFT_OPD_STORAGE_DIR and DRAFT_OPD_RAY_CACHE are passed on to the job when set.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RAY_ADDRESS:?set RAY_ADDRESS to the Ray dashboard address, e.g. http://head:8265}"
ID=${SUBMISSION_ID:-draft-opd-$(date +%Y%m%d-%H%M%S)-$RANDOM}

args=("$@")
if [[ " ${args[*]} " != *" hydra.run.dir="* ]]; then
  storage=$(python -c 'import sys
from draft_opd_ray.config.store import compose
print(compose(sys.argv[1:]).cluster.storage_dir or "")' "${args[@]}")
  if [[ -z $storage ]]; then
    echo "error: a Ray job's working dir is temporary: set cluster.storage_dir or hydra.run.dir=<a path the" \
      "cluster keeps>" >&2
    exit 2
  fi
  args=("hydra.run.dir=$storage/jobs/$ID" "${args[@]}")
fi

runtime_env=$(python -c 'import json, os
env = {k: os.environ[k] for k in ("DRAFT_OPD_STORAGE_DIR", "DRAFT_OPD_RAY_CACHE") if os.environ.get(k)}
excludes = ["/.git", "/outputs", "/multirun", "/runs", "/wandb", "/cache", "/bench/results", "/.mypy_cache",
            "/.ruff_cache", "*.safetensors", "*.parquet", "*.pt", "*.gguf", "*.bin", "__pycache__"]
print(json.dumps({"excludes": excludes, "env_vars": env}))')

ray job submit --address "$RAY_ADDRESS" --submission-id "$ID" --no-wait --working-dir . \
  --runtime-env-json "$runtime_env" --entrypoint-num-cpus "${ENTRYPOINT_NUM_CPUS:-0.1}" \
  -- python -m draft_opd_ray.main "${args[@]}"
echo "[job] submitted $ID to $RAY_ADDRESS"
[[ ${NO_FOLLOW:-0} == 1 ]] && exit 0

ray job logs --address "$RAY_ADDRESS" --follow "$ID" || true
status=$(python -c 'import sys
from ray.job_submission import JobSubmissionClient
print(JobSubmissionClient(sys.argv[1]).get_job_status(sys.argv[2]).value)' "$RAY_ADDRESS" "$ID")
echo "[job] $ID: $status"
[[ $status == SUCCEEDED ]]
