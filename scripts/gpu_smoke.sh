#!/usr/bin/env bash
set -o pipefail
# Issue-2 GPU smoke test: the local implementation in bf16 on mock data, a small model and the llama-1b shape.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print(torch.__version__)"
export PYTHONUNBUFFERED=1
SMALL="--mock-data --vocab-size 1024 --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --micro-batch-size 8 --global-batch-size 32 --train-iters 200 --lr 1e-3 --lr-warmup-iters 20 --log-interval 50 --eval-interval 100 --eval-iters 2 --bf16 --transformer-impl local"
python3 pretrain_gpt.py $SMALL 2>&1 | grep -E "iteration|validation|peak|error|Error" | tee $OUT/small.log
L1B="--mock-data --vocab-size 31999 --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32 --group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size 16 --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --train-iters 8 --log-interval 2 --eval-iters 0 --bf16 --lr 1e-4 --transformer-impl local"
python3 pretrain_gpt.py $L1B 2>&1 | grep -E "iteration|peak|parameters|memory|error|Error" | tee $OUT/l1b.log
