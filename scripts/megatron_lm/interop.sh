#!/bin/bash
# Megatron-LM checkpoints of today, written by Megatron-LM itself on the device: fixtures and references.
#
# usage (device, checkout root, after `source .devkit/setup-te.sh`; Megatron-LM's sources in .anchors/megatron and
# ../shared/anchors in .devkit/anchors, as ../shared/anchors/README.md says):
#   bash scripts/megatron_lm/interop.sh fixtures     # $OUT/mlm_fixtures.tgz: tiny Llama checkpoints, mock data
#   bash scripts/megatron_lm/interop.sh train DIR    # TP=2 on the real-text corpus below: 20 iterations, saved in DIR/td
#                                            # (torch_dist) and DIR/torch (torch format), validation loss at 20
#   bash scripts/megatron_lm/interop.sh continue DIR # Megatron-LM's own continuation of both to iteration 40 (the reference)
#   bash scripts/megatron_lm/interop.sh load CKPT NAME [FLAGS] # Megatron-LM loads a checkpoint written elsewhere and trains
#                                            # to 40 (FLAGS: e.g. --no-load-optim --no-load-rng); log load_NAME.log
#   [NPROC=n] bash scripts/megatron_lm/interop.sh here CKPT TP [FLAGS] # THIS project resumes CKPT (a Megatron-LM run, or a
#                                            # checkpoint of ours) at TP (1 or 2; NPROC defaults to TP), trains to 40;
#                                            # log here_<basename CKPT>_tp<TP>.log
# The corpus: `python tools/build_default_corpus.py --output-dir .interop/data` (this Python's docs, 676k tokens of
# GPT2BPE ids < 8192), read by Megatron-LM through its NullTokenizer with --vocab-size 8191 (8192 ids, unpadded at
# TP=2), and here with the same flags.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/flags.sh"
OPT="$COSINE $ADAMW --log-interval 1"
TINY="--num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4 --num-query-groups 2
 --seq-length 128 --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 4 --mock-data
 --tokenizer-type NullTokenizer --vocab-size 1023 --train-iters 4 --save-interval 4 --eval-iters 0
 --eval-interval 1000 --lr-warmup-iters 1"
SMALL="$SMALL_MODEL $CORPUS $EVAL40 --lr-decay-iters 40"
PORT=29600

# megatron NAME NPROC FLAGS...: one Megatron-LM run in the background, its log in $LOGS/NAME.log
megatron() {
  local name=$1 nproc=$2; shift 2
  PORT=$((PORT + 1))
  (cd "$MEG" && timeout ${TIMEOUT:-400} torchrun --nproc-per-node "$nproc" --master-port $PORT pretrain_gpt.py \
    $LLAMA $OPT "$@") > "$LOGS/$name.log" 2>&1 &
}
summary() {  # the last training line and every validation line of each log
  for f in "$@"; do
    echo "== $(basename "$f")"
    grep -E "iteration +[0-9]+/" "$f" | tail -1 | grep -oE "iteration +[0-9]+/ *[0-9]+|lm loss: [0-9.E+-]+"
    grep -E "validation (loss )?at|on validation set" -A2 "$f" | grep -oE "at iteration [0-9]+|lm loss value: [0-9.E+-]+"
    grep -m3 -E "Error|error:|Traceback" "$f" | cut -c1-240
  done
}

MODE=$1
LOGS=$OUT/mlm_logs
mkdir -p "$LOGS" /tmp/mlm
make -s -C "$MEG/megatron/core/datasets" > /dev/null  # the dataset helpers, once, before parallel launches
case $MODE in
  fixtures)
    F=/tmp/mlm/fixtures
    rm -rf $F && mkdir -p $F
    megatron td_bf16 2 $TINY $TP2 --save $F/td_bf16
    megatron td_full 2 $TINY $TP2 --save $F/td_full --dist-ckpt-optim-fully-reshardable
    megatron torch_bf16 2 $TINY $TP2 --save $F/torch_bf16 --ckpt-format torch
    megatron td_fp8_weights 2 $TINY $TP2 --save $F/td_fp8_weights --fp8-format hybrid --fp8-recipe delayed \
      --no-save-optim --no-save-rng
    megatron td_dp2 2 $TINY --save $F/td_dp2
    megatron torch_dp2 2 $TINY --save $F/torch_dp2 --ckpt-format torch
    wait
    cp "$LOGS"/*.log $F/
    summary $F/*.log
    tar -czf "$OUT/mlm_fixtures.tgz" -C /tmp/mlm fixtures && ls -la "$OUT/mlm_fixtures.tgz"
    ;;
  train)
    D=$2; mkdir -p "$D"
    megatron train_td 2 $SMALL $TP2 --save $D/td --save-interval 20 --exit-interval 20 --data-cache-path /tmp/mlm/c1
    megatron train_torch 2 $SMALL $TP2 --save $D/torch --save-interval 20 --exit-interval 20 --ckpt-format torch \
      --data-cache-path /tmp/mlm/c2
    wait; summary "$LOGS"/train_*.log
    ;;
  continue)
    D=$2
    megatron cont_td 2 $SMALL $TP2 --load $D/td --data-cache-path /tmp/mlm/c1
    megatron cont_torch 2 $SMALL $TP2 --load $D/torch --ckpt-format torch --data-cache-path /tmp/mlm/c2
    wait; summary "$LOGS"/cont_*.log
    ;;
  load)
    CKPT=$2 NAME=$3; shift 3
    megatron "load_$NAME" 2 $SMALL $TP2 --load "$CKPT" --data-cache-path /tmp/mlm/c3 "$@"
    wait; summary "$LOGS/load_$NAME.log"
    ;;
  here)
    CKPT=$2 TP=$3; shift 3
    PAR="--tensor-model-parallel-size $TP"
    [ "$TP" -gt 1 ] && PAR="$PAR --sequence-parallel"
    LOG=$LOGS/here_$(basename "$CKPT")_tp$TP.log
    NAME=$(basename "$CKPT")_tp$TP
    timeout ${TIMEOUT:-400} torchrun --nproc-per-node "${NPROC:-$TP}" --master-port $((29700 + ${#NAME} * 7 + TP)) \
      pretrain_gpt.py $LLAMA $OPT $SMALL $PAR --load "$CKPT" --data-cache-path /tmp/mlm/here_$NAME "$@" > "$LOG" 2>&1
    echo "rc=$?"; summary "$LOG"
    grep -E "validation loss at iteration" "$LOG"
    ;;
  *) echo "unknown mode $MODE"; exit 2;;
esac
