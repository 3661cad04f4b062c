"""scripts/benchmark.py without a GPU: the command lines it launches and the table it prints."""

import pstats
import re
import subprocess
import sys
import time

import pytest

from megatron.perf import step_profile
from tests.assets.scripts import ROOT, load_script

SCRIPT = ROOT / "scripts" / "benchmark.py"
benchmark = load_script("benchmark")


def test_multi_gpu_layouts_launch_torchrun_with_the_layout_flags():
    one = benchmark.command("llama-1b", "te-delayed", 10, 5)
    assert "torch.distributed.run" not in one and one[1].endswith("pretrain_gpt.py")
    tp2 = benchmark.command("llama-1b", "te-delayed", 10, 5, "tp2")
    assert "--nproc-per-node=2" in tp2
    assert tp2[tp2.index("--tensor-model-parallel-size") + 1] == "2" and "--sequence-parallel" in tp2
    graphs = benchmark.command("llama-1b", "te-delayed+graphs", 10, 5, "tp2")
    assert graphs[graphs.index("--cuda-graph-impl") + 1] == "transformer_engine" and "--fp8-recipe" in graphs
    weak = benchmark.command("llama-1b", "te-delayed", 10, 5, "tp2_dp2", weak=True)
    assert weak[len(weak) - 1 - weak[::-1].index("--global-batch-size") + 1] == "32"  # the last one wins: 16 x dp 2
    overlap = benchmark.command("llama-1b", "te-delayed", 10, 5, "tp2_overlap")
    assert "--tp-comm-overlap" in overlap and "--sequence-parallel" in overlap
    assert benchmark.run_env("tp2_overlap")["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert benchmark.run_env("dp2")["NCCL_NVLS_ENABLE"] == "0"
    gc = benchmark.command("llama-1b", "te-delayed", 10, 5, "dp2_distopt", extra="--manual-gc --manual-gc-interval 10")
    assert gc[-3:] == ["--manual-gc", "--manual-gc-interval", "10"] and "--use-distributed-optimizer" in gc


def test_table_reports_speedup_and_scaling():
    def result(config, layout, gpus, tokens):
        return benchmark.Result(
            "llama-1b", config, layout, gpus, tokens, tflops=1, mfu=1, ms_per_iter=1, loss=1, peak_gib=1
        )

    rows = benchmark.table(
        [
            result("te-bf16", "1gpu", 1, 1000.0),
            result("te-delayed", "1gpu", 1, 1300.0),
            result("te-delayed", "dp2", 2, 2470.0),
            benchmark.Result("llama-1b", "te-delayed", "tp2", 2, error="some error"),
            result("te-bf16+graphs", "1gpu", 1, 1100.0),
            result("te-delayed+graphs", "1gpu", 1, 1540.0),
        ]
    ).splitlines()
    assert "| 1.40x |" in rows[7]  # against te-bf16+graphs, not te-bf16
    assert "| 1.30x |" in rows[3]
    assert "| 1.2k |" in rows[4] and "| 95% |" in rows[4]  # 2470 / 2 per GPU against 1300
    assert "failed: some error" in rows[5]


def test_parse_log_reads_the_last_iteration_line_and_peak_memory():
    log = (
        " iteration 5/10 | elapsed time per iteration (ms): 10.0 | throughput per GPU (TFLOP/s/GPU): 1.00 |"
        " tokens/s: 100 | lm loss: 9.0E+00 |\n"
        " iteration 10/10 | elapsed time per iteration (ms): 8.0 | throughput per GPU (TFLOP/s/GPU): 2.00 |"
        " tokens/s: 200 | MFU: 5.0% | lm loss: 8.0E+00 |\n"
        "> peak memory allocated: 3.25 GiB (the most on any rank)\n"
    )
    assert benchmark.parse_log(log) == {
        "ms_per_iter": 8.0,
        "tflops": 2.0,
        "tokens_per_s": 200.0,
        "mfu": 5.0,
        "loss": 8.0,
        "peak_gib": 3.25,
        "ms_min": 8.0,
        "ms_max": 8.0,
    }


def test_parse_log_averages_the_intervals_after_the_first():
    def line(it: int, ms: float, tokens: float) -> str:
        return (
            f" iteration {it}/15 | elapsed time per iteration (ms): {ms} | throughput per GPU (TFLOP/s/GPU): 4.00 |"
            f" tokens/s: {tokens} | MFU: 10.0% | lm loss: {9 - it / 10}E+00 |\n"
        )

    # the first interval (warm-up) is left out; the last line's rates are scaled to the mean of 10 and 12 ms
    got = benchmark.parse_log(line(5, 50.0, 40) + line(10, 10.0, 240) + line(15, 12.0, 200))
    assert got["ms_per_iter"] == 11.0 and (got["ms_min"], got["ms_max"]) == (10.0, 12.0)
    assert got["tokens_per_s"] == pytest.approx(200 * 12 / 11) and got["tflops"] == pytest.approx(4 * 12 / 11)
    assert got["mfu"] == pytest.approx(10 * 12 / 11) and got["loss"] == 7.5
    row = benchmark.Result("llama-1b", "te-bf16", peak_gib=1.0, **got)
    assert row.ms_per_iter == 11.0 and "| 11 (10-12) |" in benchmark.table([row])


def test_idle_between_kernels_splits_long_and_short_gaps():
    # kernels at 0-100, 90-150 (overlapping), 155-200 (5 us gap), 300-400 (100 us gap)
    spans = [(0, 100, "a"), (90, 150, "b"), (155, 200, "c"), (300, 400, "d")]
    assert step_profile._idle_between_kernels(spans) == (0.1, 0.005)


def test_exposed_communication_is_communication_time_no_other_kernel_covers():
    # an all-reduce at 50-250 under GEMMs at 0-100 and 120-200: exposed 100-120 and 200-250; a reduce-scatter at
    # 300-340 alone; a peer-to-peer copy at 400-420 under a GEMM; two communication kernels overlapping count once
    spans = [
        (0, 100, "sm90_gemm"),
        (50, 250, "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
        (60, 90, "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
        (120, 200, "nvjet_gemm"),
        (300, 340, "ncclDevKernel_ReduceScatter"),
        (400, 420, "Memcpy PtoP (Device -> Device)"),
        (390, 450, "sm90_gemm"),
    ]
    assert step_profile._exposed_communication(spans) == {
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": 20 + 50,
        "ncclDevKernel_ReduceScatter": 40,
        "Memcpy PtoP": 0,
    }
    assert step_profile._union([(5, 9), (0, 2), (1, 3), (9, 10)]) == [(0, 3), (5, 10)]


def test_the_llama3_8b_runs_are_valid_two_gpu_configurations():
    """The Llama-3-8B shape on two GPUs, in each layout of its rows (TE swapped for the local layers: the flags are
    parsed here, where Transformer Engine does not import)."""
    from megatron.config import parse_args

    runs = [
        ("llama3-8b", "te-delayed", "tp2"),
        ("llama3-8b", "te-delayed", "pp2_vpp"),
        ("llama3-8b", "te-delayed", "pp2_vpp_balanced"),
        ("llama3-8b", "te-delayed-recompute-full", "dp2_distopt"),
        ("llama3-8b", "te-delayed-fp8params", "dp2_distopt"),
        ("llama3-8b-32k", "te-delayed", "cp2"),
        ("llama3-8b-32k", "te-delayed-fp8params-recompute-full", "cp2_distopt"),
    ]
    for preset, config, layout in runs:
        flags = [
            ("local" if f == "transformer_engine" else f) for f in benchmark.train_flags(preset, config, 10, 5, layout)
        ]
        cfg = parse_args(flags, world_size=2, device_type="cuda")
        assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_hidden_size) == (32, 4096, 14336)
        assert cfg.model.seq_length == (32768 if preset.endswith("32k") else 8192)


def test_bound_rows_print_bound_measured_and_ratio_with_fake_probes():
    import argparse

    from megatron import perf

    def fake(kind, shape):
        return {"gemm": 500.0, "hbm_copy": 3000.0}.get(kind, 2.0)  # TFLOP/s, GB/s, ms per attention

    probes = perf.Probes("fake GPU", fake)
    args = argparse.Namespace(
        iters=10, log_interval=5, weak_scaling=False, bound_profile=False, timeout=60, extra_flags=""
    )
    measured = benchmark.Result("llama-1b", "local-delayed", ms_per_iter=1000.0, tokens_per_s=1.0)
    row = benchmark.bound_row(measured, args, probes)
    assert row.errors == [] and row.bound.by_category()["attention"] == 2.0 * 16 * 8
    failed = benchmark.bound_row(benchmark.Result("llama-1b", "local-delayed", "pp2", 2, error="boom"), args, probes)
    assert failed.errors[0] == "run failed: boom" and failed.errors[1].startswith("no bound: NotModelled: ")
    report = benchmark.bound_report([row, failed])
    ratio = 1000.0 / row.bound.total_ms
    assert f"| llama-1b | local-delayed | 1gpu | {row.bound.total_ms:.1f} | 1000.0 | {ratio:.2f}x |" in report
    assert "| llama-1b | local-delayed | pp2 | - | - | - | run failed: boom; no bound: NotModelled" in report
    assert "| attention | attention fwd+bwd bf16 | 256.00 |" in report


def test_the_fsdp_layouts_parse_with_the_local_configs():
    """The FSDP rows: llama-1b and the Llama-3-8B shape under FSDP at DP=2, and with TP=2 or CP=2 on 4 GPUs (local
    layers, bf16 and FP8)."""
    from megatron.config import parse_args

    strategies = {
        "fsdp2": "optim_grads_params",
        "fsdp2_optim_grads": "optim_grads",
        "mfsdp2_optim_grads": "optim_grads",
        "mfsdp2_optim_grads_bf16comm": "optim_grads",
        "mfsdp2_bf16grads": "optim_grads",
        "mfsdp2_fp8comm": "optim_grads",
        "fsdp2_bf16grads": "optim_grads_params",
        "fsdp2_o2states": "optim_grads_params",
        "fsdp2_bf16comm": "optim_grads_params",
        "fsdp2_fp8comm": "optim_grads_params",
        "fsdp2_optim_grads_bf16comm": "optim_grads",
        "fsdp2_optim_grads_units100m": "optim_grads",
        "fsdp2_optim_grads_units200m": "optim_grads",
        "fsdp2_tp2": "optim_grads_params",
        "fsdp2_cp2": "optim_grads_params",
    }
    for preset in ("llama-1b", "llama3-8b"):
        for config in ("local-bf16", "local-delayed", "local-delayed-recompute-full", "local-delayed-fp8params"):
            for layout, strategy in strategies.items():
                gpus = benchmark.LAYOUTS[layout][0]
                flags = benchmark.train_flags(preset, config, 10, 5, layout)
                cfg = parse_args(flags, world_size=gpus, device_type="cuda")
                assert cfg.parallel.data_parallel_sharding_strategy == strategy, (preset, config, layout)
                # mfsdp2_*: the flat-buffer engine (parallel/fsdp/flat_shards.py); fsdp2_*: FSDP2
                assert cfg.sharding.flat_shards == layout.startswith("mfsdp2_"), (preset, config, layout)
                assert cfg.data_parallel_size == 2, (preset, config, layout)
                assert cfg.sharding.main_grads_bf16 == layout.endswith(("bf16grads", "o2states")), (
                    preset,
                    config,
                    layout,
                )
                assert cfg.parallel.fp8_grad_reduce == layout.endswith("fp8comm"), (preset, config, layout)
    assert "--nproc-per-node=4" in benchmark.command("llama3-8b", "local-delayed-fp8params", 10, 5, "fsdp2_tp2")
    # rowwise and mxfp8 FP8 gathers: FSDP2 only (megatron/parallel/fsdp/fp8_gather_axes.py)
    for config in ("local-rowwise-fp8params", "local-mxfp8-fp8params"):
        for layout in [name for name in strategies if name.startswith("fsdp2")]:
            flags = benchmark.train_flags("llama-1b", config, 10, 5, layout)
            assert parse_args(flags, world_size=benchmark.LAYOUTS[layout][0], device_type="cuda").precision.fp8


def test_profile_kernel_names_keep_the_foreach_functor_in_view():
    name = (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<2>, at::native::(anonymous namespace)::CopyFunctor<c10::BFloat16, 2, 1, 1>>"
    )
    assert "CopyFunctor<BFloat16" in benchmark.short_kernel_name(name)[:110]
    assert benchmark.short_kernel_name("ncclDevKernel_AllGather_RING_LL") == "ncclDevKernel_AllGather_RING_LL"


def test_host_profile_ranks_functions_by_their_own_time_per_step(tmp_path):
    def slow():  # own time: a busy loop, not a sleep (cProfile counts the thread's wall time in the function)
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass

    def fast():
        return sum(range(10))

    def step():
        slow()
        for _ in range(3):
            fast()

    lines = benchmark.host_profile(step, steps=2, top=3, stats_dir=tmp_path)
    assert re.match(r"host \(cProfile, rank's main thread\): [\d.]+ ms per step, \d+ calls per step", lines[0])
    rows = [line for line in lines if line.startswith("| ") and "test_benchmark_script.py" in line]
    name, calls, _, cumulative = (cell.strip() for cell in rows[0].strip("|").split("|"))
    # per step, and first of this file's functions by own time (its clock reads are perf_counter's own time)
    assert name.endswith(" slow") and calls == "1" and float(cumulative) >= 19
    # the whole profile, for pstats
    stats = pstats.Stats(str(tmp_path / "rank0.pstats")).stats
    assert any(name == "slow" and entry[1] == 2 for (_, _, name), entry in stats.items())


@pytest.mark.parametrize(
    "flags", [["--profile-host", "5"], ["--profile", "llama-1b", "te-bf16", "--profile-host-stats", "x"]]
)
def test_host_profile_flags_without_what_they_need_are_one_line_errors(flags):
    run = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True)
    assert run.returncode == 2 and "error: --profile-host N profiles a --profile run's host" in run.stderr
