#!/usr/bin/env bash
# The GPU study (issue 40 item 6; docs/scaling.md, "The GPU study"): Draft-OPD against SFT after an SFT plateau on
# an 8B target (Qwen3-8B; TARGET=llama31_8b for Llama-3.1-8B-Instruct), EAGLE-3 at K = 8 and DFlash at block 16,
# arms (a)-(f) of docs/results.md plus the soft-label control, 3 seeds. Settings: bench/gpu_study.yaml.
#
#   bash bench/gpu_study.sh --plan       # the plan (power estimate, analysis plan, GPU-hours, every job); anywhere
#   bash bench/gpu_study.sh --dry-run    # the plan, then every job's command run with dry_run=true: validation and
#                                        # the placement plan, no Ray, no model, no GPU, offline (config-only
#                                        # stand-ins for the weights, prompts and branch points it lacks)
#   bash bench/gpu_study.sh [--commit]   # on one 8-GPU node: every job in order; run it again after any stop
#
# Environment: TARGET (a key of `targets` in the yaml), TARGET_PATH (the local weights), PROMPTS (a JSONL file with
# a `prompt` field: >= 70,400 prompts in its train split), KINDS (eagle3,dflash), FORCE_ARMS=1 (branch even when
# the plateau rule fails), PYTHON. Each job resumes from its last checkpoint; --commit commits each finished
# job's results/ files. Exit 0 done, 1 a job failed (run again to resume), 2 no GPU / bad input, 3 the plateau
# rule stopped the study before the arms.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

# Offline machine: never reach for a hub, a usage-stats endpoint or wandb.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

mode=--run extra=()
for a in "$@"; do
  case "$a" in
    --plan|--dry-run) mode="$a" ;;
    --commit) extra+=("$a") ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_study: unknown argument $a (--plan, --dry-run, --commit)" >&2; exit 2 ;;
  esac
done

if [ "$mode" = --run ]; then
  need=$("$PY" -c "import yaml; print(yaml.safe_load(open('bench/gpu_study.yaml'))['gpus'])")
  gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
  if [ "$gpus" = 0 ]; then
    echo "gpu_study: no GPU on this machine (the study needs one $need-GPU node); --dry-run plans it here" >&2
    exit 2
  fi
  if [ "$gpus" -lt "$need" ]; then
    echo "gpu_study: $gpus GPU(s) here, the study needs one $need-GPU node (docs/scaling.md); --plan sizes it" >&2
    exit 2
  fi
  "$PY" -m draft_opd_ray.gpu_check check
fi
exec "$PY" bench/gpu_study.py "$mode" "${extra[@]+"${extra[@]}"}"
