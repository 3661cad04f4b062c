#!/bin/bash
# This project's benchmark rows and Megatron-LM's same call on one GPU, CUDA graphs on both sides
# (../shared/anchors/README.md): llama-1b bf16 and FP8 delayed, llama-8b-4l FP8 delayed, this project's rows then
# Megatron-LM's. About 8 minutes.
# Usage, on the GPU machine from the repository root, with .anchors carried (Megatron-LM's sources):
#   bash scripts/megatron_lm/compare_1gpu.sh OUTDIR
# OUTDIR gets summary.txt (both sides' last iterations) and every run's log (logs/).
set -o pipefail
OUT=${1:?usage: bash scripts/megatron_lm/compare_1gpu.sh OUTDIR}
mkdir -p "$OUT/logs"
source .devkit/setup-te.sh || exit 1
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 | tee -a "$OUT/summary.txt"
ours=(--cuda-graphs --iters 30 --log-interval 5 --timeout 240 --log-dir "$OUT/logs")
python3 scripts/benchmark.py --presets llama-1b --configs te-bf16 te-delayed "${ours[@]}" 2>&1 | grep "^| " \
  | tee -a "$OUT/summary.txt"
python3 scripts/benchmark.py --presets llama-8b-4l --configs te-delayed "${ours[@]}" 2>&1 | grep "^| " \
  | tee -a "$OUT/summary.txt"
for run in "l1b bf16 delayed" "l8b4 delayed"; do
  ITERS=30 OUT="$OUT/logs" MEG_EXTRA="--cuda-graph-impl transformer_engine" \
    bash .devkit/anchors/megatron_run.sh $run | tee -a "$OUT/summary.txt"
done
