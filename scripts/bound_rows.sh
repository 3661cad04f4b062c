#!/bin/bash
# Issue 31: each row's lower bound beside its measured step and profile (scripts/benchmark.py --bound), one GPU,
# CUDA graphs: llama-1b bf16 and FP8 delayed, llama-8b-4l FP8 delayed. About 7 minutes on an H100.
# Usage, on the GPU machine from the repository root:   bash scripts/bound_rows.sh OUTDIR
# OUTDIR gets the tables (*.txt, *.json), every run's and profile's log (logs/) and the probe cache (probes.json:
# pass it again as --probe-cache and the microbenchmarks are not rerun).
set -o pipefail
OUT=${1:?usage: bash scripts/bound_rows.sh OUTDIR}
mkdir -p "$OUT"
source .devkit/setup-te.sh || exit 1
common=(--cuda-graphs --iters 10 --log-interval 5 --timeout 240 --bound --probe-cache "$OUT/probes.json"
    --log-dir "$OUT/logs")
python3 scripts/benchmark.py --presets llama-1b --configs te-bf16 te-delayed "${common[@]}" --json "$OUT/llama-1b.json" \
    2>&1 | tee "$OUT/llama-1b.txt"
python3 scripts/benchmark.py --presets llama-8b-4l --configs te-delayed "${common[@]}" --json "$OUT/llama-8b-4l.json" \
    2>&1 | tee "$OUT/llama-8b-4l.txt"
