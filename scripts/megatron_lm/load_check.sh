#!/bin/bash
# Megatron-LM loads and trains on from checkpoints that `tools/checkpoint/convert.py --saver mcore` writes
# (docs/checkpoints.md "Continuing in Megatron-LM"). The model, data and flags are scripts/megatron_lm/interop.sh's
# SMALL Llama (4 layers, hidden 256, TE, bf16, distributed optimizer, TP=2 + SP) on the default corpus read through
# NullTokenizer --vocab-size 8191. On the device (nvidia-h100-x2), from the checkout root, with Megatron-LM's sources
# in .anchors/megatron and ../shared/anchors in .devkit/anchors, `carry: [".devkit", ".anchors"]`, each under 10 min:
#
#   source .devkit/setup-te.sh; bash scripts/megatron_lm/load_check.sh mlm     # Megatron-LM -> here -> Megatron-LM
#   source .devkit/setup-te.sh; bash scripts/megatron_lm/load_check.sh ours    # this project's checkpoint -> Megatron-LM
#
# mlm:  Megatron-LM trains 20 iterations and saves (torch_dist). The reference: Megatron-LM goes on from it to 40 with
#       --no-load-optim --no-load-rng (what any weights-only checkpoint gets: a fresh optimizer, the schedule from its
#       start). Its checkpoint converted here (--loader mcore --saver native) and back (--saver mcore: torch_dist at
#       TP=2 and TP=1, torch at TP=2) is loaded by Megatron-LM at TP=2 the same way: the weights are the same, so the
#       validation loss at 40 should equal the reference's (target: within 1%).
# ours: this project trains 20 iterations (TE layers) and saves; it goes on to 40 with a fresh optimizer at a constant
#       LR (the reference); the checkpoint converted by --saver mcore (torch_dist, torch) is loaded by Megatron-LM,
#       which goes on the same way. Validation losses at 40 compared (target: within 1%).
# Prints each validation loss at 40 and its gap to the reference in %; logs in $OUT/mlm_load_check/.
set -u
MODE=${1:-mlm}
source "$(dirname "${BASH_SOURCE[0]}")/flags.sh"
W=/tmp/mlm_load_check
LOGS=${OUT:-/tmp}/mlm_load_check
mkdir -p "$W" "$LOGS"
COMMON="$LLAMA $ADAMW --log-interval 5 $SMALL_MODEL $CORPUS $EVAL40 $TP2"
MLM_SCHEDULE="$COSINE --lr-decay-iters 40"
CONSTANT="--lr 3e-4 --lr-decay-style constant --lr-warmup-iters 0"
WEIGHTS_ONLY="--no-load-optim --no-load-rng"
PORT=29650

megatron() {  # megatron NAME FLAGS...: Megatron-LM on 2 GPUs, log in $LOGS/NAME.log
  local name=$1; shift; PORT=$((PORT + 1))
  (cd "$MEG" && timeout 300 torchrun --nproc-per-node 2 --master-port $PORT pretrain_gpt.py $COMMON "$@") \
    > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(grep -m1 -oE "successfully loaded checkpoint.*" "$LOGS/$name.log" | cut -c1-120)"
  grep -m2 -E "Error|error:" "$LOGS/$name.log" | grep -v -i warn | cut -c1-300
}
ours() {  # ours NAME FLAGS...: this project on 2 GPUs
  local name=$1; shift; PORT=$((PORT + 1))
  timeout 300 torchrun --nproc-per-node 2 --master-port $PORT pretrain_gpt.py $COMMON "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(grep -m1 -oE "successfully loaded checkpoint.*" "$LOGS/$name.log" | cut -c1-120)"; grep -m2 -E "Error|error:" "$LOGS/$name.log" | grep -v -i warn | cut -c1-300
}
convert() {  # convert NAME FLAGS...
  python tools/checkpoint/convert.py --model-type GPT "${@:2}" > "$LOGS/convert_$1.log" 2>&1
  local rc=$?
  echo "convert $1: rc=$rc $(tail -1 "$LOGS/convert_$1.log" | cut -c1-160)"
}
loss_at() {  # loss_at LOG N: the last "validation loss at iteration N" value on the validation split (Megatron-LM
  # prints its test split's loss last, on a line of the same shape ending "on test set")
  grep -E "validation loss at iteration $2 " "$LOGS/$1.log" | grep -v "test set" | tail -1 \
    | sed -E 's/.*lm loss value: ([0-9.E+-]+).*/\1/'
}
compare() {  # compare REFERENCE RUN...
  local ref; ref=$(loss_at "$1" 40); shift
  for run in "$@"; do
    python -c "import sys; r, v, name = sys.argv[1:]; g = 100 * (float(v) - float(r)) / float(r)
print(f'{name}: validation loss at 40 {v} vs reference {r}: gap {g:+.4f}% ' + ('(within 1%)' if abs(g) <= 1 else '(NOT within 1%)'))" \
      "$ref" "$(loss_at "$run" 40)" "$run" 2>/dev/null || echo "$run: no validation loss at 40 (see $LOGS/$run.log)"
  done
}
make -s -C "$MEG/megatron/core/datasets" > /dev/null

case $MODE in
  mlm)
    rm -rf "$W/mlm" && mkdir -p "$W/mlm"
    megatron mlm_train $MLM_SCHEDULE --save "$W/mlm/td" --save-interval 20 --exit-interval 20
    megatron mlm_own $MLM_SCHEDULE --load "$W/mlm/td" $WEIGHTS_ONLY
    convert to_native --loader mcore --saver native --load-dir "$W/mlm/td" --save-dir "$W/mlm/native"
    convert td_tp2 --loader native --saver mcore --load-dir "$W/mlm/native" --save-dir "$W/mlm/td_tp2" \
      --target-tensor-parallel-size 2
    convert td_tp1 --loader native --saver mcore --load-dir "$W/mlm/native" --save-dir "$W/mlm/td_tp1" \
      --target-tensor-parallel-size 1
    convert torch_tp2 --loader native --saver mcore --ckpt-format torch --load-dir "$W/mlm/native" \
      --save-dir "$W/mlm/torch_tp2" --target-tensor-parallel-size 2
    for c in td_tp2 td_tp1 torch_tp2; do megatron "mlm_from_$c" $MLM_SCHEDULE --load "$W/mlm/$c" $WEIGHTS_ONLY; done
    compare mlm_own mlm_from_td_tp2 mlm_from_td_tp1 mlm_from_torch_tp2
    ;;
  ours)
    rm -rf "$W/ours" && mkdir -p "$W/ours"
    ours ours_train $MLM_SCHEDULE --save "$W/ours/native" --save-interval 20 --exit-interval 20
    ours ours_own $CONSTANT --load "$W/ours/native" $WEIGHTS_ONLY
    convert ours_td --loader native --saver mcore --load-dir "$W/ours/native" --save-dir "$W/ours/td" \
      --target-tensor-parallel-size 2
    convert ours_torch --loader native --saver mcore --ckpt-format torch --load-dir "$W/ours/native" \
      --save-dir "$W/ours/torch" --target-tensor-parallel-size 2
    for c in td torch; do megatron "ours_mlm_$c" $CONSTANT --load "$W/ours/$c" $WEIGHTS_ONLY; done
    compare ours_own ours_mlm_td ours_mlm_torch
    ;;
  *) echo "usage: bash scripts/megatron_lm/load_check.sh mlm|ours"; exit 2;;
esac
