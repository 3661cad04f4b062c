#!/bin/bash
# Resume a Megatron-LM run here (issue 32): this project's pretrain_gpt.py --load of a checkpoint Megatron-LM wrote,
# trained to iteration 40 with the validation loss at 40, to compare with Megatron-LM's own continuation.
# usage (device, checkout root, after `source .devkit/setup-te.sh`; the run made by the lead's
# `bash scripts/mlm_interop.sh train DIR`, whose model and data flags these are):
#   [NPROC=n] bash scripts/mlm_resume_here.sh CKPT TP [more flags]   # CKPT: DIR/td or DIR/torch; TP: 2 or 1
#   (NPROC defaults to TP: TP=1 runs on one GPU; NPROC=2 with TP=1 is DP=2)
# Logs: $OUT/resume_<basename CKPT>_tp<TP>.log; prints the validation lines.
set -u
CKPT=$1 TP=$2 NPROC=${NPROC:-$2}; shift 2
export CUDA_DEVICE_MAX_CONNECTIONS=1 NVTE_FUSED_ATTN=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
LLAMA="--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
 --untie-embeddings-and-output-weights --group-query-attention --attention-dropout 0 --hidden-dropout 0 --bf16"
OPT="--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0
 --seed 1234 --log-interval 1 --transformer-impl transformer_engine --use-distributed-optimizer"
SMALL="--num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 8 --num-query-groups 4
 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 16
 --data-path .interop/data/python3.11-docs_text_document --split 98,1,1 --tokenizer-type NullTokenizer
 --vocab-size 8191 --train-iters 40 --lr-decay-iters 40 --eval-interval 20 --eval-iters 10"
PAR="--tensor-model-parallel-size $TP"
[ "$TP" -gt 1 ] && PAR="$PAR --sequence-parallel"
LOG=${OUT:-/tmp}/resume_$(basename "$CKPT")_tp$TP.log
mkdir -p "$(dirname "$LOG")"
timeout ${TIMEOUT:-400} torchrun --nproc-per-node "$NPROC" --master-port $((29700 + TP)) pretrain_gpt.py \
  $LLAMA $OPT $SMALL $PAR --load "$CKPT" --data-cache-path /tmp/ours_resume_cache "$@" > "$LOG" 2>&1
echo "rc=$? ($LOG)"
grep -E "Megatron-LM|successfully loaded|WARNING" "$LOG" | head -5
grep -E "validation loss at iteration" "$LOG"
grep -m3 -E "Error|error:|Traceback" "$LOG" | cut -c1-240
