"""The flag lists of two of Megatron-LM's launch scripts (commit d98e8a64ddf34856e74b24714e3bedb2f5a39553), as the
scripts pass them to pretrain_gpt.py, in the scripts' order and spelling, shell variables included:

* examples/llama/train_llama3_8b_h100_fp8.sh (mock-data branch), the FP8 Llama-3 8B recipe;
* examples/gpt3/train_gpt3_175b_distributed.sh, GPT-3 175B in fp16 with a batch-size schedule.

`argv` fills the variables and changes the sizes a test machine needs (and nothing else): the issue's rule is that
these run here with only their sizes, GPU counts and paths changed. The quoting is the scripts' own, and so is bash's
unquoted array expansion: the llama script's `"--split '99,1,0'"` reaches the program with its single quotes, the
GPT-3 script's `--step-batch-size-schedule "0:16 2.4B:320 ..."` as one word per threshold.
"""

from __future__ import annotations

import shlex

LLAMA3_8B_FP8 = {
    "MODEL_ARGS": """
        --use-mcore-models --num-layers $NUM_LAYERS --hidden-size 4096 --ffn-hidden-size 14336
        --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
        --seq-length $SEQ_LENGTH --max-position-embeddings $MAX_POSITION_EMBEDDINGS --position-embedding-type rope
        --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu
        --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
        --untie-embeddings-and-output-weights --disable-bias-linear""",
    "TRAINING_ARGS": """
        --micro-batch-size $MICRO_BATCH_SIZE --global-batch-size $GLOBAL_BATCH_SIZE --train-samples 1953125000
        --lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
        --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1
        --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
        --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 --exit-duration-in-mins 235
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather""",
    "DTYPE_ARGS": """
        --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather""",
    "MODEL_PARALLEL_ARGS": """
        --tensor-model-parallel-size $TP_SIZE --context-parallel-size $CP_SIZE --sequence-parallel""",
    "DATA_ARGS_LIST": """
        --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path ${DATA_CACHE_PATH}
        --tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files
        --num-workers 1""",
    "EVAL_AND_LOGGING_ARGS": """
        --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
        --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
        --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --tensorboard-dir $TENSORBOARD_LOGS_PATH""",
}

GPT3_175B = {
    "GPT_MODEL_ARGS": """
        --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
        --max-position-embeddings 2048 --attention-backend auto""",
    "TRAINING_ARGS": """
        --micro-batch-size 1 --global-batch-size 1536
        --step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536" --train-iters 500000
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16
        --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000""",
    "MODEL_PARALLEL_ARGS": """
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16""",
    "DATA_ARGS": """
        --data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1""",
    "EVAL_AND_LOGGING_ARGS": """
        --log-interval 100 --save-interval 10000 --eval-interval 1000 --save $CHECKPOINT_PATH
        --load $CHECKPOINT_PATH --eval-iters 10 --tensorboard-dir $TENSORBOARD_LOGS_PATH""",
}


def argv(script: dict[str, str], variables: dict[str, str], sizes: dict[str, str]) -> list[str]:
    """The script's arguments with its shell variables filled from `variables` and the value (the words up to the
    next flag) of each flag in `sizes` replaced by that string's words. A flag in `sizes` that the script does not
    pass is an error (the test would change the script rather than its sizes)."""
    words: list[str] = []
    for group in script.values():
        text = group
        for name, value in variables.items():
            text = text.replace("${" + name + "}", value).replace("$" + name, value)
        # bash: an array's elements (double quotes removed; single quotes inside them literal), then, as the scripts
        # expand the arrays unquoted (${ARRAY[@]}), each element split at whitespace.
        elements = shlex.split(text.replace("'", "\\'"), posix=True)
        words += [word for element in elements for word in element.split()]
    for flag, value in sizes.items():
        if flag not in words:
            raise ValueError(f"{flag} is not one of the script's flags")
        start = stop = words.index(flag) + 1
        while stop < len(words) and not words[stop].startswith("--"):
            stop += 1
        words[start:stop] = value.split()
    return words
