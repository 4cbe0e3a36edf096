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
# Both methods: REINFORCE with the running baseline (outcome 1 / -0.01, EMA 0.1, past
# batches only), 128 prompts x 1 response per update, microbatch 1, truncated importance
# sampling at 2, no ratio clipping, no reference KL, temperature 1, 4096 tokens with
# activation recompute, 200 updates, evaluation every 5 (4 samples at temperature 0.7,
# top-p 0.7), bf16 compute with fp32 master weights.
#   dense: AdamW lr 1e-6, betas (0.9, 0.95), eps 1e-8, no weight decay, no clipping,
#          warm-up (i+1)/9 then cosine to 0.1 x lr over 300 updates, no KL control.
#   logra: rank 256 Rademacher sketches of q/k/v/o/gate/up/down refreshed every update,
#          RowAdam (beta2 0.95, eps 1e-8 relative) with per-module norm restoration,
#          norm ratio 6e-5, everything else frozen, predicted-KL control (budget 2e-4 ->
#          2e-5 cosine over 300 updates, alpha <= 3, probe 2 responses per rank cut at
#          4096 tokens), update factor rounded to bf16.
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,14p' "$0" >&2
    exit 2
fi
size=$1 method=$2 seed=$3 model=$4
shift 4
case $size in
    1.5B) layout=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1) ;;
    7B)   layout=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1) ;;
    27B)  layout=(--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2) ;;
    *) echo "SIZE must be 1.5B, 7B or 27B, got '$size'" >&2; exit 2 ;;
esac
common=(--stage rl --bf16 --use-distributed-optimizer --recompute-activations
        --load "$model" --task "${TASK:-math}" --seed "$seed" --rollout-seed "$seed"
        --algorithm reinforce --failure-reward -0.01 --baseline-decay 0.9
        --prompts-per-step 128 --responses-per-prompt 1 --micro-batch-size 1
        --temperature 1.0 --tis-cap 2.0 --seq-length 4096 --max-new-tokens 3072
        --train-iters 200 --eval-interval 5 --eval-prompts "${EVAL_PROMPTS:-100}" --eval-samples 4
        --eval-temperature 0.7 --eval-top-p 0.7 --rollout-dtype bfloat16
        --save "ckpts/table1-$size-$method-s$seed" --save-interval 25
        --output-dir "runs/table1-$size-$method-s$seed")
case $method in
    dense) opt=(--optimizer adam --lr 1e-6 --adam-beta1 0.9 --adam-beta2 0.95
                --adam-eps 1e-8 --weight-decay 0 --clip-grad 0 --lr-warmup-iters 9
                --lr-decay-style cosine --lr-decay-iters 300 --min-lr 1e-7) ;;
    logra) opt=(--optimizer logra --logra-rank 256 --logra-projection rademacher
                --logra-refresh-interval 1 --logra-targets qkv,proj,fc1,fc2
                --logra-beta2 0.95 --logra-eps 1e-8 --logra-norm-restoration
                --logra-update-ratio 6e-5 --logra-untargeted frozen
                --logra-update-factor-dtype bfloat16 --logra-master-weights fp32
                --kl-control predicted --kl-budget 2e-4 --kl-budget-final 2e-5
                --kl-budget-steps 300 --kl-alpha-max 3 --kl-probe-responses 2
                --kl-probe-max-tokens 4096) ;;
    *) echo "METHOD must be dense or logra, got '$method'" >&2; exit 2 ;;
esac
cmd=(torchrun --nproc-per-node 8 launch/pretrain_rl.py "${common[@]}" "${layout[@]}"
     "${opt[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${cmd[@]}"
    echo
else
    exec "${cmd[@]}"
fi
