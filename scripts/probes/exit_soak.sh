#!/usr/bin/env bash
# Measures: how many of N finished DP=2 FP8 CPU runs exit 0 (each must).
# Usage: scripts/probes/exit_soak.sh N [OUT_DIR] -- N sequential DP=2 FP8 CPU launches.
#
# Each launch is torchrun --nproc-per-node 2 pretrain_gpt.py on a tiny Llama (local layers, the distributed optimizer,
# FP8 hybrid, 8 iterations), cycling through the variants that once aborted at exit: recipe tensorwise / delayed,
# with / without --fp8-param-gather, no checkpoint / --ckpt-format torch / torch_dist with --async-save. A launch
# fails when torchrun exits non-zero, a `terminate called` line appears (a C++ std::thread destroyed while joinable),
# or the final loss line is missing. Prints one line per launch and a summary; exits 1 when any launch failed.
# Run it from the repository root; set SOAK_PYTHON to choose the interpreter (default: python) and SOAK_JOBS to run
# that many launches at a time (default 1; the CI test runs 2, which also loads the machine as the aborts were seen),
# SOAK_SCRIPT to launch another entry point taking pretrain_gpt.py's flags (the CI test's also lists the threads left
# after main; its logs stay in OUT_DIR).
set -u
n=${1:?usage: scripts/probes/exit_soak.sh N [OUT_DIR]}
out=${2:-$(mktemp -d /tmp/exit_soak.XXXXXX)}
mkdir -p "$out"
py=${SOAK_PYTHON:-python}
script=${SOAK_SCRIPT:-pretrain_gpt.py}
TINY="--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32
 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --log-interval 1 --eval-iters 1
 --eval-interval 1000 --train-iters 8 --seed 1234"
LLAMA="--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
 --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2"
recipes=(tensorwise delayed)
gathers=("" "--fp8-param-gather")
ckpts=("" "--ckpt-format torch --save-interval 4" "--ckpt-format torch_dist --async-save --save-interval 4")
jobs=${SOAK_JOBS:-1}
launch() {  # launch I: one run, its status line in $out/status$i
    local i=$1 recipe=${recipes[$1 % 2]} gather=${gathers[($1 / 2) % 2]} ckpt=${ckpts[($1 / 4) % 3]} save="" port log
    [ -n "$ckpt" ] && save="--save $out/ckpt$i $ckpt"
    # a free port per launch: several launches (or other runs) may share the machine
    port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    log="$out/run$i.log"
    # shellcheck disable=SC2086  # the flag strings are meant to split
    OMP_NUM_THREADS=1 "$py" -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port" \
        "$script" $TINY $LLAMA --transformer-impl local --use-distributed-optimizer --fp8-format hybrid \
        --fp8-recipe "$recipe" $gather $save >"$log" 2>&1
    local rc=$? terminate final status=ok
    terminate=$(grep -c "terminate called" "$log")
    final=$(grep -c '"final_iteration": 8' "$log")
    if [ "$rc" -ne 0 ] || [ "$terminate" -ne 0 ] || [ "$final" -eq 0 ]; then
        status=FAILED
    fi
    echo "run $i: $status rc=$rc terminate=$terminate final=$final recipe=$recipe ${gather:-no-gather} ${ckpt:-no-save}" \
        >"$out/status$i"
    rm -rf "$out/ckpt$i"
}
for ((i = 0; i < n; i++)); do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    launch "$i" &
done
wait
failed=0
for ((i = 0; i < n; i++)); do
    cat "$out/status$i"
    grep -q ": ok " "$out/status$i" || failed=$((failed + 1))
done
echo "exit soak: $failed of $n launches failed (logs in $out)"
[ "$failed" -eq 0 ]
