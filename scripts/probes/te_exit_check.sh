#!/usr/bin/env bash
# Measures: whether a TE run's process groups are released at exit.
# Usage: bash scripts/probes/te_exit_check.sh [OUT_DIR=$OUT or a temp dir] -- on a GPU machine with Transformer Engine:
# whether a run's process groups are still referenced at exit ("N process group(s) still referenced after
# their release", megatron/training/shutdown.py). One GPU: tests/gpu/test_te_exit_gpu.py (TE keeps the amax group
# until megatron/model/te_state.py releases it). Two GPUs or more, also: the llama-1b te-delayed dp2_distopt row, 10
# steps, whose log must hold no such warning; any that remains names each group and the objects holding it.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${1:-${OUT:-$(mktemp -d /tmp/te_exit.XXXXXX)}}
mkdir -p "$out"
failed=0
python3 -m pytest -q tests/gpu/test_te_exit_gpu.py >"$out/test_te_exit_gpu.log" 2>&1 || failed=1
tail -5 "$out/test_te_exit_gpu.log"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    python3 scripts/benchmark.py --presets llama-1b --configs te-delayed --layouts dp2_distopt --iters 10 \
        --log-interval 5 --log-dir "$out" | tail -5
    log="$out/llama-1b.te-delayed.dp2_distopt.log"
    if [ ! -f "$log" ] || grep "still referenced" "$log"; then
        failed=1
    fi
    echo "dp2_distopt: $(grep -c "still referenced" "$log" 2>/dev/null) warning line(s) in $log"
fi
echo "te exit check: $([ "$failed" -eq 0 ] && echo ok || echo FAILED) (logs in $out)"
[ "$failed" -eq 0 ]
