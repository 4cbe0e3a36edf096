#!/usr/bin/env bash
# One run of the LoGRA paper's Table 1 on one 8-GPU node, with the reference's settings.
#
#   launch/paper_table1.sh SIZE METHOD SEED MODEL_DIR [extra launcher flags...]
#     SIZE    1.5B | 7B | 27B          (picks the layout: TP x PP x DP = 8)
#     METHOD  dense | logra
#     SEED    1 | 2 | 42               (the paper's seeds)
#     MODEL_DIR  the HF model folder (each rank reads only its own slices)
#   DRY_RUN=1 prints the command instead of running it.
#   TASK (default math) and EVAL_PROMPTS (default 100): the paper trains on its own math
#   set and evaluates on MATH-500, neither of which ships offline; --task math is the 270
#   CHAMP problems of the champ-dataset package, --task rg-hard the paper's Reasoning-Gym
#   Hard mixture (Table 3).
#
# The settings are recipes/paper/{dense,logra}-{1.5b,7b,27b}.yaml (the reference's, spelled
# out there); this script adds the model, the seeds and the output paths.
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,14p' "$0" >&2
    exit 2
fi
size=$1 method=$2 seed=$3 model=$4
shift 4
case $size in
    1.5B|7B|27B) ;;
    *) echo "SIZE must be 1.5B, 7B or 27B, got '$size'" >&2; exit 2 ;;
esac
case $method in
    dense|logra) ;;
    *) echo "METHOD must be dense or logra, got '$method'" >&2; exit 2 ;;
esac
recipe="$(cd "$(dirname "$0")/.." && pwd)/recipes/paper/$method-${size,,}.yaml"
run=(--config "$recipe" --load "$model" --seed "$seed" --rollout-seed "$seed"
     --save "ckpts/table1-$size-$method-s$seed" --output-dir "runs/table1-$size-$method-s$seed")
[ -n "${TASK:-}" ] && run+=(--task "$TASK")
[ -n "${EVAL_PROMPTS:-}" ] && run+=(--eval-prompts "$EVAL_PROMPTS")
cmd=(torchrun --nproc-per-node 8 launch/pretrain_rl.py "${run[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${cmd[@]}"
    echo
else
    exec "${cmd[@]}"
fi
