# The Megatron-LM interop runs' shared settings, sourced by scripts/megatron_lm/interop.sh and
# scripts/megatron_lm/load_check.sh: the environment of both programs, the Llama architecture, the optimizer and the
# 4-layer "small" model on the default corpus that both scripts train here and in Megatron-LM.
KIT=.devkit/anchors
MEG=$(cd "${MEGATRON_DIR:-.anchors/megatron}" && pwd)
ROOT=$(pwd)
export PYTHONPATH=$ROOT/$KIT/shim:${PYTHONPATH:-} CUDA_DEVICE_MAX_CONNECTIONS=1 NVTE_FUSED_ATTN=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
LLAMA="--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
 --untie-embeddings-and-output-weights --group-query-attention --attention-dropout 0 --hidden-dropout 0 --bf16"
ADAMW="--weight-decay 0.1 --clip-grad 1.0 --seed 1234 --transformer-impl transformer_engine --use-distributed-optimizer
 --distributed-backend nccl"
COSINE="--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5"
SMALL_MODEL="--num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 8 --num-query-groups 4
 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 16"
# the default corpus (this Python's docs), built here and carried to the device in .interop/data
ls .interop/data/*_text_document.bin > /dev/null 2>&1 || python tools/build_default_corpus.py --output-dir .interop/data
DATA=$(ls "$ROOT"/.interop/data/*_text_document.bin | head -1)
CORPUS="--data-path ${DATA%.bin} --split 98,1,1 --tokenizer-type NullTokenizer --vocab-size 8191"
EVAL40="--train-iters 40 --eval-interval 20 --eval-iters 10"
TP2="--tensor-model-parallel-size 2 --sequence-parallel"
