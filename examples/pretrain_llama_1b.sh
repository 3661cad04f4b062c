#!/usr/bin/env bash
# Llama-style 1.1B model on one node: torchrun, FP8 (hybrid format, delayed scaling), mock data by default.
# Usage: bash examples/pretrain_llama_1b.sh [extra pretrain_gpt.py flags...]
#   GPUS=8 DATA="--data-path /data/corpus_text_document --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model" \
#     bash examples/pretrain_llama_1b.sh --save ckpt/llama1b --load ckpt/llama1b
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS=${GPUS:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
DATA=${DATA:---mock-data --tokenizer-type NullTokenizer --vocab-size 31999}

MODEL=(
  --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0
)
TRAINING=(
  --micro-batch-size 2 --global-batch-size $((16 * GPUS)) --train-iters 10000
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 500 --weight-decay 0.1
  --adam-beta2 0.95 --clip-grad 1.0 --bf16 --fp8-format hybrid --fp8-recipe delayed
  --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
  --log-interval 10 --eval-interval 1000 --eval-iters 10 --save-interval 1000
)
# shellcheck disable=SC2086
exec torchrun --nproc-per-node "$GPUS" pretrain_gpt.py "${MODEL[@]}" "${TRAINING[@]}" $DATA "$@"
