#!/bin/bash
# Issue 30 on two GPUs (nvidia-h100-x2), in two device calls of under 10 minutes each:
#   bash scripts/fsdp_rows.sh tests OUTDIR   the FSDP GPU tests: TE's FP8 all-gather over 30 steps, TE meta-device
#                                            init, the FP8 gradient reduce-scatter (about 4 minutes)
#   bash scripts/fsdp_rows.sh 1b OUTDIR      llama-1b: dp2_distopt beside FSDP with bf16 and FP8 all-gathers, four-layer
#                                            units and FP8 reduce-scatters (about 6 minutes)
#   bash scripts/fsdp_rows.sh 8b OUTDIR      llama3-8b under FSDP with O2's states: FP8 and bf16 all-gathers, nothing
#                                            recomputed, then Megatron-LM's FSDP on the same model (about 8 minutes)
# OUTDIR gets a summary (summary.txt: the tables and each test's last lines) and every run's log (logs/). Megatron-LM's
# sources must be where .devkit/anchors/megatron_run.sh looks (../shared/anchors/README.md).
set -o pipefail
PART=${1:?usage: bash scripts/fsdp_rows.sh tests|1b|8b OUTDIR}
OUT=${2:?usage: bash scripts/fsdp_rows.sh tests|1b|8b OUTDIR}
mkdir -p "$OUT/logs"
source .devkit/setup-te.sh || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
bench() { python3 scripts/benchmark.py --log-dir "$OUT/logs" "$@" 2>&1 | tee -a "$OUT/summary.txt"; }
case $PART in
  tests)
    for t in test_te_fsdp test_te_fsdp_meta test_te_fsdp_fp8_reduce; do
      timeout 240 python3 -m pytest -q -x "tests/gpu/$t.py" > "$OUT/logs/$t.txt" 2>&1
      echo "$t: rc=$? $(tail -1 "$OUT/logs/$t.txt")" | tee -a "$OUT/summary.txt"
    done;;
  1b)
    # 30 iterations: the FSDP rows settled late in the third session's calls
    common=(--presets llama-1b --iters 30 --log-interval 5 --timeout 100)
    bench "${common[@]}" --configs te-delayed --layouts dp2_distopt fsdp2 fsdp2_units200m fsdp2_fp8comm
    bench "${common[@]}" --configs te-delayed-fp8params --layouts fsdp2 fsdp2_units200m;;
  8b)
    common=(--presets llama3-8b --iters 6 --log-interval 2 --timeout 160 --layouts fsdp2_o2states)
    bench "${common[@]}" --configs te-delayed-fp8params te-delayed
    NPROC=2 ITERS=15 TIMEOUT=170 OUT="$OUT/logs" MEG_EXTRA="--use-megatron-fsdp --data-parallel-sharding-strategy \
optim_grads_params --overlap-grad-reduce --overlap-param-gather --ckpt-format fsdp_dtensor --recompute-granularity \
full --recompute-method uniform --recompute-num-layers 1" bash .devkit/anchors/megatron_run.sh l3_8b delayed_pg \
      | tee -a "$OUT/summary.txt";;
  *) echo "unknown part $PART: tests, 1b or 8b"; exit 2;;
esac
