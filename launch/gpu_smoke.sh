#!/usr/bin/env bash
# The GPU smoke test: everything the CPU box cannot show, in one short run on a GPU machine (sized for under 8
# minutes on one H200; no network once the environment is installed: scripts/setup.sh gpu).
#
#   launch/gpu_smoke.sh --check       # seconds: driver vs CUDA, CUDA builds, GPUs, /dev/shm; one line, runs nothing
#                                     # exit 0 PASS (or WARN), 1 FAIL, 2 no GPU on this machine
#   launch/gpu_smoke.sh               # the check, then the stages; one line per stage, a JSON report, PASS/FAIL
#   launch/gpu_smoke.sh --dry-run     # prints every command and runs it with dry_run=true (works without a GPU)
#   launch/gpu_smoke.sh --run-dir DIR [KEY=VALUE ...]   # extra Hydra overrides go to every run
#   launch/gpu_smoke.sh --serve       # the stages, then serve (a few minutes more)
#
# Stages, on the embedded SmolLM2 target in bfloat16 with an EAGLE-3 draft:
#   one  (any GPU count; engine, replay and learner share GPU 0: +cluster=gpu_shared): a few target answers and
#        ~50 SFT steps, 3 Draft-OPD steps whose every refit is proven (opd/refit.py: the run fails when what an
#        engine serves is not what the learner sent; the file transport, as the actors share one GPU: NCCL
#        refuses two ranks on one device), then the evaluation with τ before and after Draft-OPD.
#   teacher (after one): `python -m draft_opd_ray.check_teacher` on stage one's Draft-OPD draft, 8 prompts in
#        float32: the verification pass's teacher and EAGLE-3 feature rows as captured on the GPU runner (CUDA
#        graphs, vLLM's async scheduling) against the replay's forward; PASS when its JSON line says ok.
#   serve (with --serve, after one): `python -m draft_opd_ray.serve.demo`, small: vLLM's OpenAI server on GPU 0
#        with stage one's draft learning from 24 replayed requests (a candidate every 6, the learner's side beside
#        the engine: the file refit; with 2+ GPUs on its own GPU: vLLM's NCCL draft weight transfer), then the same
#        server with the draft fixed; PASS when no request failed and a candidate was judged.
#   multi (4+ GPUs): a tensor-parallel-2 engine on GPUs 0-1, the replay actor and 2 learner ranks (one DeepSpeed
#        group) on GPUs 2-3, 3 steps of a fresh head with the NCCL refit from learner rank 0 into both TP ranks.
#        With 2-3 GPUs it is skipped (a TP engine takes whole GPUs, and two learner ranks need a GPU each).
# Each run's dir is under the top run dir (default outputs/gpu_smoke/<time>); the stages' lines go to
# <top>/smoke_report.json. SMOKE_TIMEOUT_S (default 480) caps each run. Exit 0 when every stage passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; }

check=0 dry=0 serve=0 top="" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --check) check=1 ;;
    --dry-run) dry=1 ;;
    --serve) serve=1 ;;
    --run-dir) top="${2:?--run-dir needs a folder}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) extra+=("$1") ;;
  esac
  shift
done

# Offline machine: never reach for a hub, a usage-stats endpoint or wandb.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if [ "$check" = 1 ]; then
  exec "$PY" -m draft_opd_ray.gpu_check check
fi

if [ "$dry" = 1 ]; then
  gpus="${SMOKE_GPUS:-4}"  # a dry run plans every stage, the multi-GPU one too
else
  set +e
  "$PY" -m draft_opd_ray.gpu_check check
  rc=$?
  set -e
  [ "$rc" = 0 ] || exit "$rc"
  gpus=$(nvidia-smi -L | grep -c '^GPU ')
fi
top="${top:-outputs/gpu_smoke/$(date +%Y%m%d-%H%M%S)}"

common=(
  target.path=embedded:smollm2-135m-instruct target.dtype=bfloat16 draft=eagle3 wandb.mode=disabled
  rollout.temperature=0 rollout.max_new_tokens=64 rollout.prompts_per_round=8 opd.steps=3
)
# one: 50 answers of <= 128 tokens to prompts of <= 128 tokens, one epoch in 128-token batches, so nearly every
# sequence is a step of its own (~50 SFT steps; sft.reuse=false so a rerun trains again), Draft-OPD on the 32
# train prompts after them, the evaluation on 16 held-out prompts at concurrency 1 without the ngram baseline.
one=(
  +cluster=gpu_shared "stages=[sft,opd,eval]" rollout.weight_sync=shm_file
  data.train.max_prompts=82 data.train.max_prompt_tokens=128 data.eval.max_prompts=16
  sft.num_prompts=50 sft.max_new_tokens=128 sft.batch_tokens=128 sft.train_tokens=null sft.epochs=1
  sft.reuse=false eval.max_new_tokens=64 "eval.concurrency=[1]" "eval.baselines=[]"
)
# multi: a fresh head (no SFT) at a larger step than the warm-start default so 3 steps move it; GPU shares:
# engine 2 x 1 (GPUs 0-1), replay 0.5 + learner rank 0 0.5 (GPU 2), learner rank 1 0.5 (GPU 3).
multi=(
  +cluster=gpu_shared "stages=[opd]" rollout.weight_sync=nccl "cluster.gpus_per_node=$gpus"
  cluster.rollout_tensor_parallel=2 cluster.learner_ranks=2 cluster.gpus_per_rollout=1
  cluster.gpus_per_replay=0.5 cluster.gpus_per_learner=0.5 cluster.cpus_per_node=12
  data.train.max_prompts=25 data.train.max_prompt_tokens=128 sft.num_prompts=1 optim.lr=1e-3
  optim.warmup_ratio=0
)

runs=()
dry_show() {  # dry_show NAME CMD...: a dry run's lines prefixed with the stage's name, and its exit code
  local name="$1" rc; shift
  # the plan and any error line; the libraries' log lines ("[date time][logger][LEVEL] - ...") left out
  "$@" 2>&1 | grep -v '^\[[0-9-]* [0-9:,]*\]\[' | sed "s/^/[gpu-smoke] $name | /"
  rc=${PIPESTATUS[0]}
  echo "[gpu-smoke] $name dry run: exit $rc"
  return "$rc"
}

timed() {  # timed NAME OPD_STEPS DIR CMD...: CMD under the stage time limit, its output in DIR/smoke.log; recorded
  local name="$1" steps="$2" dir="$3" start rc; shift 3
  mkdir -p "$dir"
  echo "[gpu-smoke] $name: $* (log $dir/smoke.log)"
  start=$(date +%s)
  set +e
  timeout "${SMOKE_TIMEOUT_S:-480}" "$@" >"$dir/smoke.log" 2>&1
  rc=$?
  set -e
  runs+=("$name:$rc:$(( $(date +%s) - start )):$steps:$dir")
  [ "$rc" = 0 ] || tail -n 20 "$dir/smoke.log" | sed "s/^/[gpu-smoke] $name | /"
}

stage() {  # stage NAME ARGS...: run (or dry-run) main with the common, the stage's and the user's overrides
  local name="$1"; shift
  local dir="$top/$name"
  local cmd=("$PY" -m draft_opd_ray.main "${common[@]}" "$@" "${extra[@]+"${extra[@]}"}" "hydra.run.dir=$dir")
  if [ "$dry" = 1 ]; then
    echo "[gpu-smoke] $name: ${cmd[*]} dry_run=true"
    dry_show "$name" "${cmd[@]}" dry_run=true
    return
  fi
  timed "$name" 3 "$dir" "${cmd[@]}"
}

teacher() {  # check_teacher on stage one's draft; its last line (one JSON object) goes to check_teacher.json
  local dir="$top/teacher"
  local cmd=("$PY" -m draft_opd_ray.check_teacher "${common[@]}" "draft.path=$top/one/checkpoints/opd/latest/draft"
    check.prompts.max_prompts=8 check.max_new_tokens=64 check.dtype=float32 "${extra[@]+"${extra[@]}"}")
  if [ "$dry" = 1 ]; then
    echo "[gpu-smoke] teacher: ${cmd[*]} (runs after stage one, on its draft)"
    return 0
  fi
  timed teacher 0 "$dir" "${cmd[@]}"
  tail -n 1 "$dir/smoke.log" >"$dir/check_teacher.json"
}

serve_stage() {  # the serve demo on stage one's draft (planned by every dry run; run with --serve)
  local dir="$top/serve"
  # with 2+ GPUs the learner's side gets GPU 1 of its own (vLLM's NCCL draft weight transfer), else it shares GPU 0
  local over=(+cluster=gpu_shared target.dtype=bfloat16 "cluster.gpus_per_node=$(( gpus > 1 ? 2 : 1 ))"
    serve.requests_per_update=6 serve.guard_requests=2 serve.max_versions=2 wandb.mode=disabled
    "${extra[@]+"${extra[@]}"}")
  local cmd=("$PY" -m draft_opd_ray.serve.demo --requests 24 --concurrency 4 --max-tokens 64 --windows 2
    --out "$dir" "${over[@]}" "draft.path=$top/one/checkpoints/opd/latest/draft")
  if [ "$dry" = 1 ]; then
    echo "[gpu-smoke] serve: ${cmd[*]} (runs after stage one, on its draft; its server's dry run:)"
    dry_show serve "$PY" -m draft_opd_ray.serve "${over[@]}" serve.port=8765 dry_run=true
    return
  fi
  [ "$serve" = 1 ] || return 0
  timed serve 0 "$dir" "${cmd[@]}"
}

failed=0
stage one "${one[@]}" || failed=1
teacher || failed=1
serve_stage || failed=1
if [ "$gpus" -ge 4 ]; then
  stage multi "${multi[@]}" || failed=1
else
  echo "[gpu-smoke] multi SKIP: $gpus GPU(s); the TP-2 engine and 2 learner ranks need 4"
fi
if [ "$dry" = 1 ]; then
  echo "[gpu-smoke] dry run $([ "$failed" = 0 ] && echo "PASS: every command validated" || echo FAIL)"
  exit "$failed"
fi
mkdir -p "$top"
exec "$PY" -m draft_opd_ray.gpu_check report "$top" "${runs[@]}"
