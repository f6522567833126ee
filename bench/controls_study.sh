#!/usr/bin/env bash
# The default run's claim as a controlled comparison (docs/results.md, "The default run's controls"): from the
# default warm start, Draft-OPD with the defaults (`opd`) and three controls at its training FLOPs: SFT continued
# on the warm start's answers (`sft`), hard labels (`sft_rollouts`) and the teacher's top-k (`sft_rollouts_soft`)
# on the committed tokens of the same rollouts, no replay. Each arm is one piece (~5-40 min on 2 cores), then its
# evaluation on the validation split and MT-Bench (n = 80 each) and the export of its per-prompt counts to
# results/<NAME>/, which `python -m draft_opd_ray.compare results/<NAME>` reads. Run it again after a stop: finished
# arms are skipped, a stopped one continues from its last checkpoint (every 5 steps), measured drafts are kept.
#
#   SEEDS="0 1 2" bash bench/controls_study.sh                 # everything, ~2 h a seed on 2 cores
#   SEEDS=1 ARMS="opd sft" bash bench/controls_study.sh        # a session's piece
#   INTO=docs/results.md SEEDS=2 bash bench/controls_study.sh  # ... and rewrite the doc's summary block at the end
#
# A study whose results dir holds a `pinned` file (one commit) runs at that commit only, so that all its seeds run
# one code and one prompt split: run it from a checkout of that commit (`git worktree add ../study <commit>`) with
# RESULTS pointing back at this checkout's results dir.
set -euo pipefail
NAME=${NAME:-default_controls}
SEEDS=${SEEDS:-0 1 2}
ARMS=${ARMS:-opd sft sft_rollouts_soft sft_rollouts}
RESULTS=${RESULTS:-results/$NAME}
S=(--name "$NAME")
EVAL=(--sets validation,mtbench --eval-prompts 80)
PRIMARY=validation:opd:sft
HERE=$(cd "$(dirname "$0")/.." && pwd)
PINNED_FILE=$HERE/results/$NAME/pinned
[[ -f "$RESULTS/pinned" ]] && PINNED_FILE=$RESULTS/pinned
if [[ -f "$PINNED_FILE" ]]; then
  pinned=$(head -n1 "$PINNED_FILE")
  head_commit=$(git -C "$HERE" rev-parse --short=7 HEAD)
  if [[ "$head_commit" != "${pinned:0:7}" ]]; then
    echo "controls_study.sh: $NAME is pinned to commit $pinned ($PINNED_FILE), this checkout is $head_commit." >&2
    echo "  git worktree add ../study-$NAME $pinned && cd ../study-$NAME && \\" >&2
    echo "  RESULTS=$HERE/results/$NAME bash bench/controls_study.sh" >&2
    exit 2
  fi
fi

for seed in $SEEDS; do
  for arm in $ARMS; do
    python bench/study.py controls "${S[@]}" --arms "$arm" --seeds "$seed"
    python bench/study.py eval "${S[@]}" "${EVAL[@]}" --last --only "${arm}_s${seed}" --baseline sft
    python bench/study.py export "${S[@]}" "${EVAL[@]}" --to "$RESULTS" --primary "$PRIMARY" \
      --question "Does Draft-OPD with the defaults beat its no-replay controls at matched training FLOPs?"
  done
done
python -m draft_opd_ray.compare "$RESULTS" ${INTO:+--into "$INTO"}  # INTO=docs/results.md rewrites its summary block
