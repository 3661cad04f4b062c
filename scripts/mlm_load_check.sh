#!/bin/bash
# Megatron-LM loads and continues from checkpoints that `tools/checkpoint/convert.py --saver mcore` writes (issue 32,
# part 3; docs/checkpoints.md "Continuing in Megatron-LM"). On the device, from the checkout root, with Megatron-LM's
# sources in .anchors/megatron (../shared/anchors/README.md) and `carry: [".devkit", ".anchors"]`:
#
#   source .devkit/setup-te.sh; bash scripts/mlm_load_check.sh              # one GPU: Megatron-LM at TP=1
#   source .devkit/setup-te.sh; TP=2 bash scripts/mlm_load_check.sh         # two GPUs (nvidia-h100-x2): TP=2
#
# 1. This project trains a small Llama (TE layers, bf16) for 30 iterations on the default corpus (its ids read
#    through NullTokenizer, which both programs have), saves it (torch_dist, one GPU), and goes on at TP for 20 iterations from that checkpoint
#    with a fresh optimizer (--no-load-optim --no-load-rng, constant LR): the reference validation losses.
# 2. convert.py --saver mcore writes the checkpoint for Megatron-LM at TP, in torch_dist and in torch.
# 3. Megatron-LM (as ../shared/anchors/megatron_run.sh runs it) loads each: --skip-train evaluates the loaded weights
#    (compare with this project's validation loss at iteration 30), then 20 iterations continued as in 1.
# Prints each validation loss and its gap to this project's in %; the target is within 1%. Logs go to $OUT.
set -u
TP=${TP:-1}
OUT=${OUT:-/tmp/mlm_load_check}
WORK=${WORK:-/tmp/mlm_load_check_work}
MEG=${MEGATRON_DIR:-.anchors/megatron}
KIT=${KIT:-.devkit/anchors}
ROOT=$(pwd)
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
export PYTHONPATH=$ROOT/$KIT/shim:${PYTHONPATH:-} CUDA_DEVICE_MAX_CONNECTIONS=1 NVTE_FUSED_ATTN=1 PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0

PREFIX=$(python tools/build_default_corpus.py --output-dir "$WORK/data") || { echo "corpus build failed"; exit 1; }
PREFIX=$(cd "$(dirname "$PREFIX")" && pwd)/$(basename "$PREFIX")
MODEL="--num-layers 4 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 --group-query-attention
 --num-query-groups 4 --seq-length 512 --max-position-embeddings 512 --position-embedding-type rope
 --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0
 --hidden-dropout 0 --bf16 --transformer-impl transformer_engine --micro-batch-size 8 --global-batch-size 16
 --data-path $PREFIX --split 98,2,0 --tokenizer-type NullTokenizer --vocab-size 8192 --seed 1234
 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --log-interval 10 --eval-iters 20"
CONTINUE="--train-iters 50 --lr 3e-4 --lr-warmup-iters 0 --lr-decay-style constant --eval-interval 50
 --no-load-optim --no-load-rng"

loss() {  # the lm loss value of the last "validation loss at iteration N" line of log $1
    grep "validation loss at iteration $2 " "$1" | tail -1 | sed -E 's/.*lm loss value: ([0-9.E+-]+).*/\1/'
}

echo "=== this project: train 30 iterations, save; continue 20 with a fresh optimizer"
python pretrain_gpt.py $MODEL --train-iters 30 --lr 3e-4 --lr-warmup-iters 5 --lr-decay-style constant \
    --eval-interval 30 --save "$WORK/ours" --save-interval 30 > "$OUT/ours_train.log" 2>&1
echo "rc=$?"
torchrun --nproc-per-node "$TP" --master-port 29512 pretrain_gpt.py $MODEL $CONTINUE \
    --tensor-model-parallel-size "$TP" --load "$WORK/ours" > "$OUT/ours_continue.log" 2>&1
echo "rc=$?"
REF30=$(loss "$OUT/ours_train.log" 30); REF50=$(loss "$OUT/ours_continue.log" 50)
echo "this project: validation loss at 30 = $REF30, at 50 (continued) = $REF50"

for FMT in torch_dist torch; do
    echo "=== convert.py --saver mcore --ckpt-format $FMT --target-tensor-parallel-size $TP"
    python tools/checkpoint/convert.py --model-type GPT --loader native --saver mcore --ckpt-format "$FMT" \
        --load-dir "$WORK/ours" --save-dir "$WORK/mlm_$FMT" --target-tensor-parallel-size "$TP" \
        > "$OUT/convert_$FMT.log" 2>&1
    echo "rc=$?"; tail -1 "$OUT/convert_$FMT.log"
    RUN="torchrun --nproc-per-node $TP --master-port 29511 pretrain_gpt.py $MODEL $CONTINUE
        --tensor-model-parallel-size $TP --load $WORK/mlm_$FMT --distributed-backend nccl"
    echo "=== Megatron-LM: --load ($FMT) --skip-train"
    (cd "$MEG" && timeout 600 $RUN --skip-train) > "$OUT/megatron_${FMT}_eval.log" 2>&1
    echo "rc=$?"; grep -m1 -E "loaded checkpoint|Error|error:" "$OUT/megatron_${FMT}_eval.log" | cut -c1-300
    echo "=== Megatron-LM: --load ($FMT), 20 iterations"
    (cd "$MEG" && timeout 600 $RUN) > "$OUT/megatron_${FMT}_continue.log" 2>&1
    echo "rc=$?"; grep -m1 -E "Error|error:" "$OUT/megatron_${FMT}_continue.log" | cut -c1-300
    M30=$(loss "$OUT/megatron_${FMT}_eval.log" 30); M50=$(loss "$OUT/megatron_${FMT}_continue.log" 50)
    python - "$FMT" "$REF30" "$M30" "$REF50" "$M50" <<'EOF'
import sys
fmt, pairs = sys.argv[1], sys.argv[2:]
for at, (ours, theirs) in zip((30, 50), zip(pairs[::2], pairs[1::2])):
    try:
        gap = 100 * (float(theirs) - float(ours)) / float(ours)
        print(f"{fmt}: validation loss at {at}: Megatron-LM {theirs}, this project {ours}, gap {gap:+.3f}%"
              f" ({'within' if abs(gap) <= 1 else 'NOT within'} 1%)")
    except ValueError:
        print(f"{fmt}: validation loss at {at}: Megatron-LM {theirs!r}, this project {ours!r}: missing (see logs)")
EOF
done
