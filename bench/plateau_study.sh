#!/usr/bin/env bash
# One draft kind's study (docs/results.md) as one chain: the plateau, its curve, the arms, then one evaluation of
# every arm. Run the same command again after a stop (a session's end, a killed job): finished steps are skipped
# and a run stopped mid-way continues from its last checkpoint.
#
#   KIND=standalone NAME=standalone6_f32 bash bench/plateau_study.sh   # ~10 h on 2 AVX2 cores, ~5 h with bfloat16
#   KIND=eagle3 NAME=eagle3_5m bash bench/plateau_study.sh             # ~2 h of plateau, then ~50 min an arm
#
# KIND picks the plateau's budget and the default arm groups: standalone, a 6-layer slice to 740k tokens, arms
# (a)-(b) for seeds 0 and 1 and (c)-(f) for seed 0; eagle3, to 5.12M tokens, arms (a)-(c) for seeds 0 and 1.
# ARMS picks the arm groups, each `arms:seeds`, in order; CURVE=0 skips the C1 curve. A new machine has an empty
# runs/, so a session that can hold only part of the chain names the part it runs, e.g.
#
#   NAME=standalone6_740k CURVE=0 ARMS="fkl,rkl:0 random:0" bash bench/plateau_study.sh
#
# `auto` precision makes the branch point a float32 draft on a CPU without AVX512-BF16 and a bfloat16 one on a CPU
# with it: keep one NAME per kind of machine (the results name the study they come from).
set -euo pipefail
KIND=${KIND:-standalone}
case $KIND in
  standalone)
    NAME=${NAME:-standalone6_f32}
    PLATEAU=(--set draft.num_layers=6 --tokens 740000 --doublings 4)
    GROUPS_=${ARMS:-opd,sft:0,1 sft_rollouts,fkl,rkl,random:0} ;;
  eagle3)
    NAME=${NAME:-eagle3_5m}
    PLATEAU=(--tokens 5120000 --doublings 6)
    GROUPS_=${ARMS:-opd,sft,sft_rollouts:0,1} ;;
  *) echo "KIND=$KIND: expected standalone or eagle3" >&2; exit 2 ;;
esac
S=(--kind "$KIND" --name "$NAME")
DIR=runs/study/$NAME

python bench/study.py plateau "${S[@]}" "${PLATEAU[@]}"
# C1: tau of every export on the validation split (n = 40); --only matches no arm
if [ "${CURVE:-1}" != 0 ] && [ ! -f "$DIR/plateau/eval/curve.json" ]; then
  python bench/study.py eval "${S[@]}" --sets validation --exports --only none
fi
# C2: opd, sft; C5: sft_rollouts; C3: fkl, rkl; C4: random
for group in $GROUPS_; do
  python bench/study.py arms "${S[@]}" --arms "${group%%:*}" --seeds "${group##*:}" --steps 15
done
python bench/study.py eval "${S[@]}" --sets validation,mtbench --eval-prompts 80 --last
