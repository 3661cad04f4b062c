#!/usr/bin/env bash
# Measures: whether DP=2 NCCL runs exit cleanly. Usage: bash scripts/probes/gpu_exit_check.sh [N=10] [OUT_DIR=$OUT or a
# temp dir] -- on a machine with 2 GPUs, N DP=2 NCCL runs (torchrun --nproc-per-node 2, a small Llama in bf16 with FP8
# hybrid) must each exit 0 with no `terminate called` line. Runs alternate Transformer Engine / local layers, delayed /
# tensorwise scaling, and no checkpoint / torch_dist --async-save / torch; exits 1 if any run failed. Also reported, not
# failed on: the ranks on which a communication thread (gloo, NCCL, the TCP store) still ran after main returned (the
# names each rank saw follow).
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # tests/assets/exit_probe.py imports pretrain_gpt
n=${1:-10}
out=${2:-${OUT:-$(mktemp -d /tmp/gpu_exit.XXXXXX)}}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
SMALL="--mock-data --vocab-size 1024 --num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 8
 --group-query-attention --num-query-groups 4 --seq-length 256 --micro-batch-size 4 --global-batch-size 16
 --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
 --untie-embeddings-and-output-weights --train-iters 20 --lr 1e-3 --lr-warmup-iters 5 --log-interval 5
 --eval-interval 1000 --eval-iters 2 --bf16 --fp8-format hybrid --use-distributed-optimizer"
impls=(transformer_engine local)
recipes=(delayed tensorwise)
ckpts=("" "--ckpt-format torch_dist --async-save --save-interval 10" "--ckpt-format torch --save-interval 10")
failed=0
threads_left=0
for ((i = 0; i < n; i++)); do
    impl=${impls[i % 2]}
    recipe=${recipes[(i / 2) % 2]}
    ckpt=${ckpts[i % 3]}
    save=""
    [ -n "$ckpt" ] && save="--save $out/ckpt$i $ckpt"
    log="$out/gpu_run$i.log"
    # shellcheck disable=SC2086  # the flag strings are meant to split
    torchrun --nproc-per-node 2 --master-port $((29600 + i)) tests/assets/exit_probe.py $SMALL \
        --transformer-impl "$impl" --fp8-recipe "$recipe" $save >"$log" 2>&1
    rc=$?
    terminate=$(grep -c "terminate called" "$log")
    final=$(grep -c '"final_iteration": 20' "$log")
    left=$(grep "threads after main" "$log" | grep -ciE "gloo|nccl|tcpstore")
    status=ok
    [ "$left" -ne 0 ] && threads_left=$((threads_left + 1))
    if [ "$rc" -ne 0 ] || [ "$terminate" -ne 0 ] || [ "$final" -eq 0 ]; then
        status=FAILED
        failed=$((failed + 1))
    fi
    echo "gpu run $i: $status rc=$rc terminate=$terminate final=$final ranks-with-threads-left=$left $impl $recipe ${ckpt:-no-save}"
    grep "threads after main" "$log"
    rm -rf "$out/ckpt$i"
done
echo "gpu exit check: $failed of $n runs failed; $threads_left runs left a communication thread (logs in $out)"
[ "$failed" -eq 0 ]
