#!/bin/bash
# Issue 30 on two GPUs (nvidia-h100-x2), in device calls of under 10 minutes each:
#   bash scripts/fsdp_rows.sh tests OUTDIR   the FSDP GPU tests: TE's FP8 all-gather over 30 steps (per tensor and
#                                            blockwise), the first gather's transpose, the FP8 guard and monitor, the
#                                            freed bf16 shards, TE meta-device init, the FP8 gradient reduce-scatter,
#                                            the cached FP8 shard cast, the calibration pass recomputed (one GPU) and
#                                            TE's state released at exit (about 8 minutes)
#   bash scripts/fsdp_rows.sh new OUTDIR     the GPU tests of the latest changes (the sixteenth session's): the fused
#                                            RoPE kernel (its cos/sin table kept on the angles), CUDA graphs (which
#                                            build their own), the TE model, TE under the flat buckets (one
#                                            bucket-allocating hook per layer) (~6 min)
#   bash scripts/fsdp_rows.sh 1b OUTDIR      llama-1b: FSDP with FP8 and bf16 all-gathers, one- and four-layer units,
#                                            beside dp2_distopt, each row with its lower bound (about 9 minutes)
#   bash scripts/fsdp_rows.sh host OUTDIR    llama-1b's host-bound FSDP step (optim_grads): the profile of
#                                            dp2_distopt and of one-, two- and four-layer units in one call (a
#                                            host-bound step moves with the machine's CPU), and the host-device
#                                            synchronizations per step of dp2_distopt and FSDP (about 8 minutes)
#   bash scripts/fsdp_rows.sh 8b OUTDIR      llama3-8b under FSDP with O2's states, FP8 all-gathers, nothing
#                                            recomputed: delayed scaling with its calibration pass (every layer
#                                            recomputed in the pass), and with FP8 attention and no pass; then the
#                                            profile of the step without the pass (about 8 minutes)
#   bash scripts/fsdp_rows.sh 8b-nccl OUTDIR the same step (no pass) beside the same with NCCL's kernels limited to
#                                            8 CTAs (NCCL_MAX_CTAS) and with units of two layers (about 8 minutes)
#   bash scripts/fsdp_rows.sh megatron OUTDIR  llama3-8b: this project's FSDP row and Megatron-LM's FSDP (FP8,
#                                            --fp8-param-gather, its precision-aware optimizer with fp16 masters and
#                                            fp8/fp16 moments, every layer recomputed) in one call (about 7 minutes)
#   bash scripts/fsdp_rows.sh zero2 OUTDIR   optim_grads on the flat buckets (megatron/parallel/fsdp/flat_shards.py):
#                                            its GPU test (TE writing unzeroed buckets), llama-1b beside dp2_distopt twice over (A B A B: the eighth session's two
#                                            calls disagreed by 15%; 60 iterations each) and its profile after 30
#                                            iterations (~7 min)
#   bash scripts/fsdp_rows.sh zero2-1b OUTDIR  llama-1b: the flat buckets with bf16 reduce-scatters beside
#                                            dp2_distopt, both configs on both engines (ROWS, PASSES, EXTRA: flags
#                                            for every run), with each row's intervals (~55 s a row) and its
#                                            gap to dp2_distopt per pass with their median and mean (row_gaps.py);
#                                            PROFILE_AT="10 50": the first row profiled after 10 and 50 iterations.
#                                            NCCL_INFO=1: and how NCCL joined the GPUs (transports,
#                                            ring graph types) beside each row.
#                                            Repeated pairs in one call: PASSES=4 ROWS="te-delayed-fp8params:
#                                            mfsdp2_optim_grads_bf16comm te-delayed-fp8params:dp2_distopt" (~8 min)
#   bash scripts/fsdp_rows.sh zero2-nccl OUTDIR  llama-1b ROWS (default: the flat buckets and dp2_distopt) with
#                                            NCCL's transports and graphs beside each row, once with NCCL's own
#                                            protocol and once with NCCL_PROTO=Simple (~6 min)
#   bash scripts/fsdp_rows.sh ab-1b OUTDIR    llama-1b: the flat buckets against dp2_distopt in one process per rank,
#                                            steps alternated in blocks (scripts/ab_steps.py; AB_LAYOUTS, AB_FLAGS)
#                                            (~4 min)
#   bash scripts/fsdp_rows.sh timers-1b OUTDIR  llama-1b: the wall-clock host time of each engine's functions per step
#                                            and per call, every rank (scripts/engine_timers.py; LAYOUTS;
#                                            TIMERS_FLAGS=--parts: the torch calls inside them too) (~2 min)
#   bash scripts/fsdp_rows.sh host-1b OUTDIR  llama-1b: where each engine's host spends the step, the flat buckets
#                                            against dp2_distopt (LAYOUTS: others, the first against the second):
#                                            GPU profile, every rank's cProfile (OUTDIR/<layout>/rank<r>.pstats) and
#                                            their function-by-function difference per rank (~3 min)
#   bash scripts/fsdp_rows.sh zero2-8b OUTDIR  llama3-8b on the flat buckets: weights whole (FP8), O2's states, two
#                                            and three layers recomputed (~6 min)
#   bash scripts/fsdp_rows.sh noreshard OUTDIR  --torch-fsdp2-no-reshard-after-forward: its GPU test (TE, bf16 and FP8,
#                                            --fp8-param-gather over 30 steps), TE's meta-device init under the
#                                            flat-bucket engine, then llama-1b fsdp2_noreshard beside
#                                            fsdp2 and dp2_distopt with their lower bounds (estimated 19.07 GiB
#                                            against fsdp2's 17.24) (about 7 minutes)
#   bash scripts/fsdp_rows.sh blockwise OUTDIR  llama-1b with TE's blockwise FP8 weights gathered as FP8 under FSDP
#                                            (fsdp2) beside the same config on dp2_distopt and per-tensor FP8
#                                            gathers under fsdp2 (COMPARE: other rows; ~5 min); PROFILE=1: and the
#                                            blockwise FSDP step's profile (~2 min more)
#   bash scripts/fsdp_rows.sh parity OUTDIR  loss parity on real text at DP=2 of the flat-bucket engine (FP8 weights)
#                                            and of the distributed optimizer's te-delayed against the bf16 run in
#                                            docs/loss_parity/llama-150m-fsdp-dp2.json (same data and seed),
#                                            llama-150m, 1000 iterations each (about 8 minutes; needs
#                                            .interop/parity.tar.xz: tools/build_parity_corpus.py's .bin/.idx, tarred);
#                                            PARITY_CONFIGS=te-delayed-fp8params+zero2-chunkce: the same with the
#                                            chunked loss (--cross-entropy-fusion-impl chunked);
#                                            te-delayed-fp8params+zero2-bf16comm: bf16 reduce-scatters;
#                                            +zero2-bf16grads: bf16 gradient shards and reduce-scatters;
#                                            +zero2-fp8comm: FP8 reduce-scatters (O1's communication);
#                                            te-delayed+fsdp2-optim-grads: PyTorch's FSDP2 under optim_grads
#                                            gathering bf16, where TE keeps its weight casts for the step (two
#                                            micro-batches per rank, so that the second reuses the first's);
#                                            te-delayed-fp8params+fsdp2-optim-grads: the same with FP8 gathers;
#                                            PARITY_DEADLINE: seconds for the runs (560); PARITY_DRY_RUN=1:
#                                            print the runs' commands only
# OUTDIR gets a summary (summary.txt: the tables and each test's last lines) and every run's log (logs/). Megatron-LM's
# sources must be where .devkit/anchors/megatron_run.sh looks (../shared/anchors/README.md).
set -o pipefail
usage="usage: bash scripts/fsdp_rows.sh tests|new|1b|host|8b|8b-nccl|megatron|zero2|zero2-1b|zero2-nccl|ab-1b|timers-1b|host-1b|zero2-8b|noreshard|blockwise|parity OUTDIR"
PART=${1:?$usage}
OUT=${2:?$usage}
mkdir -p "$OUT/logs"
source .devkit/setup-te.sh || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
# how the two GPUs are joined (NV# = NVLink): a pair without NVLink runs the collectives several times slower
nvidia-smi topo -m 2>&1 | head -3 | tee -a "$OUT/summary.txt"
# how fast this machine's host is: llama-1b's FSDP step is host-bound where it is slow (seventeenth session: the flat
# buckets within 1.1% of dp2_distopt on one machine, 3.4-8.5% behind on two others of the same kind)
lscpu | grep -E "^Model name|^CPU\(s\)|^CPU max MHz" | tr -s ' ' | tee -a "$OUT/summary.txt"
python3 -c '
import sys, time, torch
if not torch.cuda.is_available():
    sys.exit("host: no GPU here to time a kernel launch on")
x = torch.zeros(1, device="cuda")
for _ in range(2000):
    x.add_(1)
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(20000):
    x.add_(1)
launch = (time.perf_counter() - start) / 20000 * 1e6
torch.cuda.synchronize()
print(f"host: {launch:.2f} us to launch a tiny kernel (20000 in a row)")
' 2>&1 | tee -a "$OUT/summary.txt"
# (LOGS: another folder for a repeated row's logs, which would overwrite the first's)
bench() { python3 scripts/benchmark.py --log-dir "${LOGS:-$OUT/logs}" "$@" 2>&1 | tee -a "$OUT/summary.txt"; }
# llama-1b rows ("CONFIG:LAYOUT ...") in turn, PASSES times (default $1), 60 iterations each, every second pass in
# reverse order (a drift over the call, e.g. the GPUs warming, then favours no row). Each row's ms per 10-iteration
# interval goes to the summary (both engines' intervals moved by 10% within a run). The first pass's logs in
# OUTDIR/pass1 (not under logs/: files deeper than OUTDIR/*/* do not come back from the device), later passes' in a
# scratch folder (at most 8 files come back).
llama1b_passes() {
  [ -z "${NCCL_INFO:-}" ] || export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH  # nccl_links reads what they print
  for pass in $(seq "${PASSES:-$1}"); do
    local logs="$OUT/${PASS_DIR:-pass}$pass"
    [ "$pass" = 1 ] || logs="${TMPDIR:-/tmp}/fsdp_rows/pass$pass"
    mkdir -p "$logs"
    local rows=$2
    [ $((pass % 2)) = 1 ] || rows=$(tr ' ' '\n' <<< "$2" | tac | paste -sd' ')
    for row in $rows; do
      local log="$logs/llama-1b.${row%%:*}.${row#*:}.log"
      watch_start
      LOGS="$logs" bench --presets llama-1b --iters 60 --log-interval 10 --timeout 110 \
        --extra-flags="${EXTRA:-}" --configs "${row%%:*}" --layouts "${row#*:}"
      echo "$row: $(sed -n 's/.*per iteration (ms): \([0-9.]*\).*/\1/p' "$log" | paste -sd' ') |" \
        "$(watch_stop)$(nccl_links "$log")" | tee -a "$OUT/summary.txt"
    done
  done
}
# What the machine did during a row, beside its times: runs of one call differ by 10-12% and a slow run is slow in
# every interval (fourteenth session), so each row records its GPUs' mean SM clock (MHz), power (W), peak temperature
# and the share of busy samples held back by a clock-event reason (power or thermal caps: reasons other than idle,
# 0x1) with the commonest one (0x4, the software power cap, on every row of the fifteenth session), and the CPU
# time the host stole from this machine's vCPUs (/proc/stat), which would slow a host-bound step. A row that runs
# slow at a high clock and low power left its GPUs waiting (on the host or the peer), not throttled.
watch_start() {
  nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active \
    --format=csv,noheader,nounits -lms 1000 > /tmp/fsdp_rows_watch.csv 2>/dev/null &
  WATCH=$!
  read -r _ user nice system idle iowait irq softirq steal _ < /proc/stat
  STAT0=($((user + nice + system + idle + iowait + irq + softirq + steal)) "$steal")
}
watch_stop() {
  kill "$WATCH" 2> /dev/null; wait "$WATCH" 2> /dev/null
  read -r _ user nice system idle iowait irq softirq steal _ < /proc/stat
  local total=$((user + nice + system + idle + iowait + irq + softirq + steal - STAT0[0]))
  awk -F', *' -v steal=$((steal - STAT0[1])) -v total="$total" '
    $5 >= 50 { n[$1]++; mhz[$1] += $2; w[$1] += $3; if ($4 > t[$1]) t[$1] = $4
               r = $6; sub(/^0x0*/, "", r); if (r ~ /^[0-9a-fA-F]+$/ && r != "1") { held[$1]++; why[$1 " 0x" r]++ } }
    END { for (g in n) { top = ""; for (k in why) if (index(k, g " ") == 1 && (top == "" || why[k] > why[top])) top = k
                         sub(/^[^ ]* /, "", top)
                         printf "gpu%s %d MHz %d W %d C held %d%% %s; ", g, mhz[g] / n[g], w[g] / n[g], t[g],
                                100 * held[g] / n[g], top }
          printf "steal %.1f%%", total ? 100 * steal / total : 0 }' /tmp/fsdp_rows_watch.csv
}
# NCCL_INFO=1: each row's ranks log NCCL's set-up (NCCL_DEBUG=INFO, subsystems INIT and GRAPH), and the row's line
# gets how NCCL joined the GPUs: its transports (P2P over NVLink, or SHM through host memory) and the type and
# bandwidth of its ring graphs. The fifteenth session's profiles showed only low-latency (LL) NCCL kernels on an NV18
# pair, the protocol NCCL keeps to where it sees no NVLink (LL128 needs it); a host path would also make the
# collectives' speed follow the host's.
nccl_links() {
  [ -n "${NCCL_INFO:-}" ] || return 0
  printf ' | nccl: %s%s' \
    "$(grep -o 'via [A-Za-z0-9/_]*' "$1" | sort | uniq -c | awk '{printf "%s x%d; ", $3, $1}')" \
    "$(grep -o 'bw [0-9.]*/[0-9.]*, type [A-Z/]*' "$1" | sort | uniq -c | awk '{printf "%s %s %s x%d; ", $2, $3, $5, $1}')"
}
# the profile of llama-1b row $1 (CONFIG:LAYOUT) after $2 iterations, its top $3 kernels
profile_1b() {
  echo "profile of $1 after $2 iterations" | tee -a "$OUT/summary.txt"
  timeout 120 python3 scripts/benchmark.py --profile llama-1b "${1%%:*}" --layouts "${1#*:}" --profile-warmup "$2" \
    --profile-steps 3 --profile-top "$3" 2>&1 | grep -A$(($3 + 30)) "^step " | tee -a "$OUT/summary.txt"
}
case $PART in
  tests)
    for t in test_te_calibration_recompute test_te_exit_gpu test_te_fsdp_transpose test_te_fsdp test_te_fsdp_blockwise test_te_fsdp_guard test_te_fsdp_free_shards \
        test_te_fsdp_meta test_te_fsdp_fp8_reduce "test_fp8_gpu -k fsdp_shard_cast"; do
      read -r file select <<< "$t"
      timeout 150 python3 -m pytest -q -x -s "tests/gpu/$file.py" $select > "$OUT/logs/$file.txt" 2>&1
      echo "$t: rc=$? $(tail -1 "$OUT/logs/$file.txt")" | tee -a "$OUT/summary.txt"
    done;;
  new)
    # the GPU tests of the latest changes: the RoPE kernel's cos/sin table kept on the angles tensor between layers,
    # and not while a graph is captured (sixteenth session); the TE model against the local one; TE under the flat
    # buckets, which since the sixteenth session allocate a layer's buckets from one hook on its output's gradient
    for t in test_rope_kernel test_cuda_graphs test_te_model test_te_grad_shards; do
      timeout 150 python3 -m pytest -q -x "tests/gpu/$t.py" > "$OUT/logs/$t.txt" 2>&1
      echo "$t: rc=$? $(tail -1 "$OUT/logs/$t.txt")" | tee -a "$OUT/summary.txt"
    done;;
  1b)
    # 30 iterations: the FSDP rows settled late in the third session's calls
    # with each row's lower bound (megatron/perf/fsdp.py for the FSDP rows) and its profile pass
    common=(--presets llama-1b --iters 30 --log-interval 5 --timeout 100 --bound --probe-cache "$OUT/probes.json")
    bench "${common[@]}" --configs te-delayed-fp8params --layouts fsdp2 fsdp2_units200m
    bench "${common[@]}" --configs te-delayed --layouts dp2_distopt fsdp2 fsdp2_units200m;;
  host)
    for layout in dp2_distopt fsdp2_optim_grads fsdp2_optim_grads_units100m fsdp2_optim_grads_units200m; do
      timeout 100 python3 scripts/benchmark.py --profile llama-1b te-delayed --layouts $layout --profile-steps 3 2>&1 \
        | tail -45 | tee -a "$OUT/summary.txt"
    done
    for layout in dp2_distopt fsdp2_optim_grads; do
      timeout 75 python3 scripts/sync_check.py llama-1b te-delayed $layout 2>&1 | tail -12 | tee -a "$OUT/summary.txt"
    done;;
  8b)
    common=(--presets llama3-8b --iters 6 --log-interval 2 --timeout 200 --layouts fsdp2_o2states)
    # delayed scaling with its calibration pass (every layer recomputed in it since the sixth session), and FP8
    # attention without it; then where the FP8 step goes
    bench "${common[@]}" --configs te-delayed-fp8params te-delayed-fp8params-nocalib-fp8attn
    timeout 200 python3 scripts/benchmark.py --profile llama3-8b te-delayed-fp8params-nocalib --layouts fsdp2_o2states \
      --profile-top 40 2>&1 | grep -A80 "^step " | tee -a "$OUT/summary.txt";;
  8b-nccl)
    # fewer SMs for the NCCL kernels that run beside the GEMMs (511 ms of them per 2449 ms step, 26 ms exposed)
    common=(--presets llama3-8b --iters 6 --log-interval 2 --timeout 200 --layouts fsdp2_o2states)
    bench "${common[@]}" --configs te-delayed-fp8params-nocalib
    # each 8B row is ~150 s, ~130 of them startup: three rows fit a call
    echo "NCCL_MAX_CTAS=8" | tee -a "$OUT/summary.txt"
    NCCL_MAX_CTAS=8 bench "${common[@]}" --configs te-delayed-fp8params-nocalib
    # and units of two layers (half the per-unit host work and collectives)
    bench "${common[@]/fsdp2_o2states/fsdp2_o2states_units400m}" --configs te-delayed-fp8params-nocalib;;
  megatron)
    # ours and Megatron-LM's in one call, both with low-precision optimizer states; Megatron-LM's FSDP ran out of
    # memory at its second iteration without recomputation (seventh session), so every layer is recomputed there
    bench --presets llama3-8b --iters 6 --log-interval 2 --timeout 200 --layouts fsdp2_o2states \
      --configs te-delayed-fp8params-nocalib
    NPROC=2 ITERS=10 TIMEOUT=260 OUT="$OUT/logs" MEG_EXTRA="--use-megatron-fsdp --data-parallel-sharding-strategy \
optim_grads_params --overlap-grad-reduce --overlap-param-gather --ckpt-format fsdp_dtensor \
--megatron-fsdp-main-params-dtype fp16 --megatron-fsdp-main-grads-dtype bf16 --recompute-granularity full \
--recompute-method uniform --recompute-num-layers 1" bash .devkit/anchors/megatron_run.sh l3_8b delayed_pg_o2 \
      | tee -a "$OUT/summary.txt";;
  zero2)
    # first: TE's wgrad GEMMs write the engine's unzeroed (here NaN-filled) buckets whole (overwrite_main_grad)
    # (NO_TEST=1 / NO_PROFILE=1 leave out the test / the profile, where a call has run it or lacks the time)
    if [ -z "$NO_TEST" ]; then
      timeout 120 python3 -m pytest -q -x tests/gpu/test_te_grad_shards.py > "$OUT/logs/test_te_grad_shards.txt" 2>&1
      echo "test_te_grad_shards: rc=$? $(tail -1 "$OUT/logs/test_te_grad_shards.txt")" | tee -a "$OUT/summary.txt"
    fi
    # ZERO2_LAYOUTS: the engine's rows of each pass, then dp2_distopt. Its default reduce-scatters fp32 every
    # micro-batch (4 here: 18 GB a step against the distributed optimizer's one fp32 reduction of 4.4 GB);
    # mfsdp2_optim_grads_bf16comm halves it. Each row ~85 s: three rows a pass need NO_TEST=1 NO_PROFILE=1 (PASSES=1:
    # one pass).
    rows=""
    for layout in ${ZERO2_LAYOUTS:-mfsdp2_optim_grads}; do rows+="te-delayed-fp8params:$layout "; done
    llama1b_passes 2 "${rows}te-delayed:dp2_distopt"
    [ -n "$NO_PROFILE" ] || profile_1b te-delayed-fp8params:mfsdp2_optim_grads 30 30;;
  zero2-1b)
    # llama-1b, the flat buckets' bf16 reduce-scatters beside dp2_distopt like for like (each config on both
    # engines), ROWS in turn (CONFIG:LAYOUT), PASSES times; EXTRA: flags for every run. The engine's intervals spread
    # 10-20% within a run in the eleventh session (Python's garbage collector is not why: scripts/host_overhead.py
    # counts ~1 young collection a step on both engines).
    ROWS=${ROWS:-te-delayed-fp8params:mfsdp2_optim_grads_bf16comm te-delayed-fp8params:dp2_distopt te-delayed:mfsdp2_optim_grads_bf16comm te-delayed:dp2_distopt}
    llama1b_passes 1 "$ROWS"
    # each row's gap to dp2_distopt's of its config, pass by pass, their median and mean: calls, and runs within a
    # call, differ by 5-10% (zero2's rows are not like for like: its dp2_distopt row runs te-delayed, the others FP8
    # weights)
    python3 scripts/row_gaps.py --reference dp2_distopt "$OUT/summary.txt" 2>&1 | tee -a "$OUT/summary.txt"
    # PROFILE_AT="10 50": the first row profiled after that many iterations each (~80 s apiece): whether what grows
    # during a run (the eighth session's 408 -> 467 ms) is kernel time or the GPU waiting between kernels
    for warmup in ${PROFILE_AT:-}; do profile_1b "${ROWS%% *}" "$warmup" 25; done;;
  zero2-nccl)
    # how NCCL joins the two GPUs beside each row (NCCL_INFO: transports, ring graphs), and what its protocol costs:
    # a pass of ROWS with NCCL's own choice (the fifteenth session's profiles: only low-latency kernels, RING_LL),
    # then the same pass with NCCL_PROTO=Simple (logs in OUTDIR/simple1), in one call (~6 min for two rows)
    export NCCL_INFO=1
    ROWS=${ROWS:-te-delayed-fp8params:mfsdp2_optim_grads_bf16comm te-delayed-fp8params:dp2_distopt}
    llama1b_passes 1 "$ROWS"
    echo "NCCL_PROTO=Simple:" | tee -a "$OUT/summary.txt"
    NCCL_PROTO=Simple PASS_DIR=simple llama1b_passes 1 "$ROWS"
    # pass 1 NCCL's choice, pass 2 Simple: each engine's gap to dp2_distopt under both
    python3 scripts/row_gaps.py --reference dp2_distopt "$OUT/summary.txt" 2>&1 | tee -a "$OUT/summary.txt";;
  ab-1b)
    # llama-1b: the flat buckets and dp2_distopt built side by side in one process per rank, their steps alternated in
    # blocks (scripts/ab_steps.py: the machine's drift over minutes cancels within each block's turns; no start-up
    # per row). AB_LAYOUTS: the layouts, each compared with the last (three llama-1b fit: ~6 min); AB_FLAGS:
    # ab_steps.py's other flags (default 12 blocks of 10 steps: ~4 min for two layouts)
    timeout 540 python3 scripts/ab_steps.py --preset llama-1b --config te-delayed-fp8params \
      --layouts ${AB_LAYOUTS:-mfsdp2_optim_grads_bf16comm dp2_distopt} ${AB_FLAGS:-} > "$OUT/logs/ab_steps.log" 2>&1
    echo "ab_steps.py: rc=$?" | tee -a "$OUT/summary.txt"
    grep -E "^\||median|during its turns|^\{" "$OUT/logs/ab_steps.log" | tee -a "$OUT/summary.txt";;
  timers-1b)
    # what the flat buckets' host does per bucket and micro-batch beyond the distributed optimizer's, in real
    # microseconds (cProfile inflates small calls), every layout built in one process per rank
    timeout 300 python3 scripts/engine_timers.py --preset llama-1b --config te-delayed-fp8params \
      --layouts ${LAYOUTS:-mfsdp2_optim_grads_bf16comm mfsdp2_optim_grads_bf16comm_b100m dp2_distopt} \
      ${TIMERS_FLAGS:-} > "$OUT/logs/engine_timers.log" 2>&1
    echo "engine_timers.py: rc=$?" | tee -a "$OUT/summary.txt"
    grep "^\[rank" "$OUT/logs/engine_timers.log" | tee -a "$OUT/summary.txt";;
  host-1b)
    # where each engine's host spends the step: each layout (LAYOUTS) profiled on the GPU (rank 0's kernels, every
    # rank's busy and gap lines) and then under cProfile on every rank (--profile-host), its whole profile in
    # OUTDIR/<layout>/rank<r>.pstats; then the first layout's functions against the second's, rank by rank: what the
    # sixteenth session found by hand (~1 min a layout)
    set -- ${LAYOUTS:-mfsdp2_optim_grads_bf16comm dp2_distopt}
    steps=4  # profiled steps: pstats_diff.py divides by them
    for layout; do
      echo "profile of $layout (host: $steps steps)" | tee -a "$OUT/summary.txt"
      timeout 170 python3 scripts/benchmark.py --profile llama-1b te-delayed-fp8params --layouts "$layout" \
        --profile-warmup 20 --profile-steps $steps --profile-top 30 --profile-host 40 \
        --profile-host-stats "$OUT/$layout" > "$OUT/logs/profile.$layout.log" 2>&1
      grep -E -A75 "^step |^\[rank [0-9]+\] (step|GPU|comm|host)" "$OUT/logs/profile.$layout.log" \
        | tee -a "$OUT/summary.txt"
    done
    for rank in 0 1; do
      echo "rank $rank: $1 against $2" | tee -a "$OUT/summary.txt"
      python3 scripts/pstats_diff.py "$OUT/$1/rank$rank.pstats" "$OUT/$2/rank$rank.pstats" --steps $steps \
        --top 20 2>&1 | tee -a "$OUT/summary.txt"
    done;;
  zero2-8b)
    # llama3-8b with its weights whole (FP8) and O2's states: with none or one layer recomputed it runs out of memory
    # or stalls on H100s, so two (eleventh session: 2242 ms, 14.6k tokens/s per GPU, 74.3 GiB) beside three. CONFIGS:
    # other rows (each ~3 min: two fit a call), e.g. te-bf16-recompute-block12 (bf16 on the same layout, 70.9 GiB) or
    # the chunked loss (te-delayed-fp8params-nocalib-fp8attn-chunkce-recompute-block1: 73.8 GiB, but ~170 ms a step
    # slower). Expandable segments against the fragmentation of the near-full card.
    CONFIGS=${CONFIGS:-te-delayed-fp8params-nocalib-fp8attn-recompute-block2 te-delayed-fp8params-nocalib-fp8attn-recompute-block3}
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench --presets llama3-8b --iters 6 --log-interval 2 \
      --timeout 230 --layouts mfsdp2_o2states --configs $CONFIGS
    # PROFILE=CONFIG: where that row's step goes (~3.5 min more)
    [ -z "$PROFILE" ] || PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 230 python3 scripts/benchmark.py \
      --profile llama3-8b "$PROFILE" --layouts mfsdp2_o2states --profile-top 40 2>&1 | grep -A80 "^step " \
      | tee -a "$OUT/summary.txt";;
  noreshard)
    timeout 200 python3 -m pytest -q -x -s tests/gpu/test_te_fsdp.py -k no_reshard > "$OUT/logs/test_te_fsdp_no_reshard.txt" 2>&1
    echo "test_te_fsdp -k no_reshard: rc=$? $(tail -1 "$OUT/logs/test_te_fsdp_no_reshard.txt")" | tee -a "$OUT/summary.txt"
    timeout 100 python3 -m pytest -q -x tests/gpu/test_te_fsdp_meta.py -k flat_bucket > "$OUT/logs/test_te_meta_zero2.txt" 2>&1
    echo "test_te_fsdp_meta -k flat_bucket: rc=$? $(tail -1 "$OUT/logs/test_te_meta_zero2.txt")" | tee -a "$OUT/summary.txt"
    common=(--presets llama-1b --iters 30 --log-interval 5 --timeout 100 --bound --probe-cache "$OUT/probes.json")
    bench "${common[@]}" --configs te-delayed --layouts dp2_distopt fsdp2 fsdp2_noreshard;;
  blockwise)
    # TE's blockwise-scaled FP8 weights gathered as FP8 (their test: tests/gpu/test_te_fsdp_blockwise.py, in `tests`)
    # beside the distributed optimizer and beside per-tensor FP8 gathers on the same layout (the fourteenth session's
    # blockwise FSDP row ran 1.74x the distributed optimizer's step); PROFILE=1: then where its step goes
    for row in te-blockwise-fp8params:fsdp2 te-blockwise-fp8params:dp2_distopt ${COMPARE:-te-delayed-fp8params:fsdp2}; do
      bench --presets llama-1b --iters 30 --log-interval 5 --timeout 110 --configs "${row%%:*}" --layouts "${row#*:}"
    done
    [ -z "$PROFILE" ] || timeout 150 python3 scripts/benchmark.py --profile llama-1b te-blockwise-fp8params \
      --layouts fsdp2 --profile-steps 3 --profile-top 30 2>&1 | grep -A60 "^step " | tee -a "$OUT/summary.txt";;
  parity)
    mkdir -p data && tar -xJf .interop/parity.tar.xz -C data || exit 1
    D="--data-path data/parity/parity_text_document --split 98,1,1 --tokenizer-type GPT2BPETokenizer \
--vocab-file megatron/data/assets/stdlib-bpe-vocab.json --merge-file megatron/data/assets/stdlib-bpe-merges.txt"
    # the flat-bucket engine (optim_grads on the distributed optimizer's buckets) with FP8 weights, and the
    # distributed optimizer's te-delayed at DP=2 (the seventh session's version-counter fix of its all-gathers)
    Z="--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads"
    # PyTorch's FSDP2 under optim_grads, two micro-batches per rank (the others run one of 16), so that with bf16
    # gathers the second reuses the FP8 weight casts TE keeps from the first
    OG="--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads --micro-batch-size 8"
    # named as in docs/loss_parity/ (the report links its plot by name), so the three files copy there as they are
    P="$OUT/llama-150m-fsdp-dp2"
    cp docs/loss_parity/llama-150m-fsdp-dp2.json "$P.json"  # merged: runs of the same name are replaced
    # each run's flags (loss_parity.py refuses flags for a run it is not given)
    declare -A FLAGS=([te-delayed-fp8params+zero2]="$Z" [te-delayed+distopt]="--use-distributed-optimizer"
      [te-delayed-fp8params+zero2-chunkce]="$Z --cross-entropy-loss-fusion --cross-entropy-fusion-impl chunked"
      [te-delayed-fp8params+zero2-bf16comm]="$Z --megatron-fsdp-grad-comm-dtype bf16"
      [te-delayed-fp8params+zero2-bf16grads]="$Z --megatron-fsdp-main-grads-dtype bf16"
      [te-delayed-fp8params+zero2-fp8comm]="$Z --fp8-grad-reduce"
      [te-delayed+fsdp2-optim-grads]="$OG" [te-delayed-fp8params+fsdp2-optim-grads]="$OG")
    RUNS=(${PARITY_CONFIGS:-te-delayed-fp8params+zero2 te-delayed+distopt}) FLAG_ARGS=()
    for run in "${RUNS[@]}"; do FLAG_ARGS+=(--config-flags "$run=${FLAGS[$run]:?no flags for $run}"); done
    timeout $((${PARITY_DEADLINE:-560} + 20)) python3 scripts/loss_parity.py --preset llama-150m --eval-iters 5 \
      --nproc-per-node 2 --deadline "${PARITY_DEADLINE:-560}" $D --results "$P.json" --log-dir "$OUT/logs" \
      --out "$P.md" --configs "${RUNS[@]}" "${FLAG_ARGS[@]}" ${PARITY_DRY_RUN:+--dry-run} 2>&1 | tail -12 \
      | tee -a "$OUT/summary.txt";;
  *) echo "unknown part $PART: tests, new, 1b, host, 8b, 8b-nccl, megatron, zero2, zero2-1b, zero2-8b, noreshard, blockwise or parity"; exit 2;;
esac
