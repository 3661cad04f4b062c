"""megatron/perf on CPU: the lower bound's arithmetic against hand-computed values, with a fake probe table."""

import json

import pytest

from megatron import perf
from megatron.config import parse_args
from megatron.config.sharding import fsdp_layer_units
from megatron.perf import fsdp, traffic, work
from megatron.training.flops import num_floating_point_operations

# 2 layers, h 64, 4 heads of 16 in 2 groups, SwiGLU width 128, sequence 32, micro-batch 2, global batch 4 (2
# micro-batches), vocabulary 127 + end-of-document = 128: T = 64 tokens per micro-batch.
TINY = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention"
    " --num-query-groups 2 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4"
    " --vocab-size 127 --tokenizer-type NullTokenizer --mock-data --position-embedding-type rope --normalization"
    " RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --bf16 --transformer-impl local"
    " --lr 1e-4 --train-iters 1"
)
FP8 = " --fp8-format hybrid --fp8-recipe delayed"
RATES = {"bf16": 100.0, "fp8": 200.0}  # TFLOP/s
HBM = 1000.0  # GB/s
BUS = 50.0  # GB/s
ATTENTION = {0: 0.5, 1: 2.0}  # ms: forward, forward + backward


def config(extra: str = "", world_size: int = 1):
    return parse_args((TINY + extra).split(), world_size=world_size)


class FakeDevice:
    """A probe table: fixed rates, and a log of what was measured."""

    def __init__(self, fail: tuple[str, ...] = ()):
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail

    def __call__(self, kind: str, shape: dict) -> float:
        self.calls.append((kind, dict(shape)))
        if any(f in perf.Probes.key(kind, shape) for f in self.fail):
            raise RuntimeError("no kernel for this\nsecond line")
        if kind == "gemm":
            return RATES[shape["dtype"]]
        if kind.startswith("attention_"):
            return ATTENTION[shape["bwd"]]
        if kind == "hbm_copy":
            return HBM
        return BUS


def probes(device=None, cache=None):
    return perf.Probes("fake GPU", device or FakeDevice(), cache)


def test_gemm_flops_of_a_tiny_model_by_hand():
    cfg = config(FP8)
    assert perf.padded_vocab(cfg) == 128
    gemms = work.gemms(cfg, 128)
    # per linear (in x out): qkv 64 x 128, proj 64 x 64, fc1 64 x 256 (SwiGLU's two halves), fc2 128 x 64
    qkv = [g for g in gemms if g.name.startswith("linear_qkv")]
    assert {(g.name, g.m, g.n, g.k, g.fp8, g.count) for g in qkv} == {
        ("linear_qkv fprop", 64, 128, 64, True, 2),  # the second layer, 2 micro-batches
        ("linear_qkv dgrad", 64, 64, 128, True, 2),
        ("linear_qkv wgrad", 128, 64, 64, True, 2),
        ("linear_qkv fprop", 64, 128, 64, False, 2),  # the first layer stays bf16
        ("linear_qkv dgrad", 64, 64, 128, False, 2),
        ("linear_qkv wgrad", 128, 64, 64, False, 2),
    }
    assert all(not g.fp8 for g in gemms if g.name.startswith("output_layer"))
    # 3 GEMMs x 2 FLOPs x T x sum(in x out) x layers x micro-batches, + the output layer's 3 x 2 x T x h x V x 2
    layers = 6 * 64 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64) * 2 * 2
    output = 6 * 64 * 64 * 128 * 2
    assert sum(g.flops for g in gemms) == layers + output == 62_914_560
    assert sum(g.flops for g in gemms if g.fp8) == layers // 2
    # the same as Megatron-LM's model FLOPs without their attention (s/h) term: 12 B s^2 L q
    model = num_floating_point_operations(cfg.model, 4, 128) - 12 * 4 * 32 * 32 * 2 * 64
    assert sum(g.flops for g in gemms) == model
    no_wgrad = work.gemms(config(FP8 + " --no-fp8-wgrad"), 128)
    assert sum(g.flops for g in no_wgrad if g.fp8) == layers // 2 * 2 // 3


def test_attention_counts_the_causal_half_and_backward_as_two_and_a_half_forwards():
    [a] = work.attention(config(FP8))
    assert (a.batch, a.seq, a.heads, a.groups, a.head_dim, a.fp8, a.count) == (2, 32, 4, 2, 16, False, 4)
    assert a.forward_flops == 2 * 2 * 4 * 16 * 32 * 32  # QK^T and PV over half of the 32 x 32 scores
    assert a.flops == 3.5 * a.forward_flops * 4
    # Megatron-LM's full-square, backward = 2 x forward convention: 12 B s^2 L q; ours is 7/12 of it
    assert a.flops == 12 * 4 * 32 * 32 * 2 * 64 * 7 / 12


def test_memory_bytes_of_a_tiny_model_by_hand():
    items = traffic.memory_traffic(config(FP8), 128)
    E, Q, K, F = 64 * 64, 64 * 64, 64 * 32, 64 * 128
    layer = 8 * E + 12 * E + 12 * E + 12 * E + 8 * (Q + 2 * K) + 6 * F + 10 * F  # norms, residual adds, RoPE, SwiGLU
    fp8_extra = 4 * Q + 4 * E  # attention output cast, FP8 copies of the two residual gradients
    outside = 4 * 64 * 64 + 10 * 64 * 64 + 10 * E + 6 * 64 * 128  # embedding fwd/bwd, final norm, loss
    params = 2 * 128 * 64 + 2 * (36864 + 2 * 64) + 64
    assert work.param_count(config(FP8), 128) == (params, 36864)
    optimizer = 38 * params  # fp32 main params and moments: 8 + 8 + 8, gradient 4 x 3, bf16 weights 2
    expected = 2 * (2 * layer + fp8_extra + outside) + optimizer + 4 * 36864
    assert sum(i.total_bytes for i in items) == expected == 5_451_648
    by_name = {i.name: i for i in items}
    assert by_name["FP8 weight casts"].total_bytes == 4 * 36864
    assert by_name["attention output -> FP8 [FP8 layers]"].count == 2  # one FP8 layer x 2 micro-batches
    fp8_params = {i.name: i.total_bytes for i in traffic.memory_traffic(config(FP8 + " --fp8-param-gather"), 128)}
    assert fp8_params["FP8 weight casts"] == 2 * 36864  # the transpose only
    assert fp8_params["Adam step + grad zero + grad norm"] == optimizer - 36864  # FP8 weights: 1 byte written
    # learned absolute positions: no RoPE pass (the position embedding's lookup is in the embedding's bytes)
    learned = TINY.replace("--position-embedding-type rope", "--position-embedding-type learned_absolute")
    names = {i.name for i in traffic.memory_traffic(parse_args(learned.split()), 128)}
    assert "RoPE fwd+bwd [FP8 layers]" in by_name and not any(name.startswith("RoPE") for name in names), names


def test_the_bound_is_the_sum_of_its_parts_at_the_probed_rates():
    cfg = config(FP8)
    bound = perf.lower_bound(cfg, probes(), log=lambda line: None)
    gemms = work.gemms(cfg, 128)
    gemm_ms = sum(g.flops / (RATES["fp8" if g.fp8 else "bf16"] * 1e12) * 1e3 for g in gemms)
    memory_ms = 5_451_648 / (HBM * 1e9) * 1e3
    by_category = bound.by_category()
    assert by_category["gemm"] == pytest.approx(gemm_ms, rel=1e-12)
    assert by_category["attention"] == pytest.approx(4 * ATTENTION[1])
    assert by_category["communication"] == 0
    assert bound.total_ms == pytest.approx(gemm_ms + 4 * ATTENTION[1] + memory_ms, rel=1e-12)
    assert sum(by_category.values()) == pytest.approx(bound.total_ms)
    assert bound.params == work.param_count(cfg, 128)[0]


def test_recomputation_adds_its_forward_again():
    plain = perf.lower_bound(config(FP8), probes(), log=lambda line: None)
    full = config(FP8 + " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    bound = perf.lower_bound(full, probes(), log=lambda line: None)
    fprop = sum(g.flops for g in work.gemms(full, 128) if "fprop" in g.name and not g.name.startswith("output"))
    assert sum(g.flops for g in work.recompute_gemms(full, 128)) == fprop
    extra = bound.by_category()["attention"] - plain.by_category()["attention"]
    assert extra == pytest.approx(4 * ATTENTION[0])  # every layer's attention forward, once per micro-batch
    assert bound.by_category()["norm"] > plain.by_category()["norm"]
    selective = config(FP8 + " --recompute-activations")
    assert work.recompute_gemms(selective, 128) == []
    assert [a.name for a in work.attention(selective)] == ["attention fwd+bwd", "attention fwd (recomputed)"]


def test_tensor_and_data_parallel_communication():
    tp = config(FP8 + " --tensor-model-parallel-size 2 --sequence-parallel", world_size=2)
    comm = {c.name: c for c in traffic.communication(tp, 128)}
    full = 2 * 64 * 64  # one [T, h] bf16 tensor
    gathers = [c for c in comm.values() if c.op == "all_gather" and c.name.startswith("TP all-gather (norm")]
    assert sorted((c.nbytes, c.count) for c in gathers) == [(full // 2, 8), (full, 8)]  # FP8 layer, bf16 layer
    assert comm["TP reduce-scatter (proj, fc2 / qkv, fc1 dgrad)"].count == 4 * 2 * 2
    assert work.linear_shapes(tp, 128)["linear_qkv"] == (64, 64) and traffic._sizes(tp, 128)["E"] == 64 * 32
    tp.parallel.tp_comm_overlap = True  # (a TE-only flag: set after parsing on this CPU)
    assert traffic.communication(tp, 128) == []
    dp = config(" --overlap-grad-reduce --ddp-bucket-size 1000", world_size=2)
    [reduction] = traffic.communication(dp, 128)
    assert (reduction.op, reduction.nbytes, reduction.ranks, reduction.count) == ("all_reduce", 4000, 2, 1)
    bound = perf.lower_bound(dp, probes(), log=lambda line: None)
    assert bound.by_category()["communication"] == pytest.approx(4000 * 1 / (BUS * 1e9) * 1e3)
    distributed = config(" --use-distributed-optimizer", world_size=2)
    ops = {c.name: (c.op, c.nbytes) for c in traffic.communication(distributed, 128)}
    params = work.param_count(distributed, 128)[0]
    assert ops == {
        "DP gradient reduction": ("reduce_scatter", 4 * params),
        "DP parameter all-gather": ("all_gather", 2 * params),
    }


def test_grad_shards_traffic_and_communication():
    """--use-megatron-fsdp optim_grads (parallel/fsdp/flat_shards.py) at DP=2, two micro-batches: the distributed
    optimizer's step without the whole buffer's zeroing (the shards are read, 2 x 4 bytes per shard element, never
    zeroed), the first micro-batch's reduce-scatter output copied into the shards (4 + 4 per shard element) and the
    second's added (4 + 2 x 4; the buckets are not zeroed); a bf16 reduce-scatter halves the buckets' bytes. One
    bucket's reduce-scatter is left exposed, as with --overlap-grad-reduce."""
    zero2 = " --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --ddp-bucket-size 1000"
    batch = " --global-batch-size 8"
    cfg, distopt = config(zero2 + batch, world_size=2), config(" --use-distributed-optimizer" + batch, world_size=2)
    params = work.param_count(cfg, 128)[0]
    assert cfg.num_micro_batches == 2
    got, want = memory_by_name(cfg), memory_by_name(distopt)
    step = "Adam step + grad zero + grad norm"
    assert got["Adam step + grad norm"] == want[step] - 4 * params
    assert (got["gradient shard copy"], got["gradient shard add"]) == ((4 + 4) * params / 2, (4 + 8) * params / 2)
    shards = ("Adam step + grad norm", "gradient shard copy", "gradient shard add")
    assert {n: b for n, b in got.items() if n not in shards} == {n: b for n, b in want.items() if n != step}
    bf16 = memory_by_name(config(zero2 + batch + " --megatron-fsdp-grad-comm-dtype bf16", world_size=2))
    assert (bf16["gradient shard copy"], bf16["gradient shard add"]) == ((2 + 4) * params / 2, (2 + 8) * params / 2)
    ops = {c.name: (c.op, c.nbytes) for c in traffic.communication(cfg, 128)}
    assert ops == {
        "DP gradient reduction": ("reduce_scatter", 4 * 1000),
        "DP parameter all-gather": ("all_gather", 2 * params),
    }


def test_pipeline_layouts_are_not_modelled():
    with pytest.raises(perf.NotModelled, match="pipeline/context"):
        perf.lower_bound(config(" --pipeline-model-parallel-size 2", world_size=2), probes())


def test_probes_are_cached_per_device_and_shape(tmp_path):
    cache = tmp_path / "probes.json"
    device = FakeDevice()
    first = perf.lower_bound(config(FP8), probes(device, cache), log=lambda line: None)
    measured = len(device.calls)
    assert measured == len({perf.Probes.key(kind, shape) for kind, shape in device.calls})  # each shape once
    again = FakeDevice()
    second = perf.lower_bound(config(FP8), probes(again, cache), log=lambda line: None)
    assert again.calls == [] and second.total_ms == first.total_ms  # a second run costs nothing
    perf.lower_bound(config(FP8 + " --seq-length 64 --max-position-embeddings 64"), probes(again, cache))
    assert again.calls and all(kind != "hbm_copy" for kind, _ in again.calls)  # new shapes only
    other = FakeDevice()
    perf.Probes("another GPU", other, cache).hbm_gbps()
    assert other.calls == [("hbm_copy", {"nbytes": 1 << 30})]
    assert set(json.loads(cache.read_text())) == {"fake GPU", "another GPU"}
    with pytest.raises(perf.ProbeError, match="needs a GPU|no device"):
        perf.Probes("cpu", None).hbm_gbps()


def test_failed_probes_fall_back_with_one_line():
    lines = []
    device = FakeDevice(fail=("dtype=fp8",))
    bound = perf.lower_bound(config(FP8), probes(device), log=lines.append)
    assert len(lines) == 1 and "FP8 GEMM probe failed, bf16 rate used" in lines[0] and "\n" not in lines[0]
    gemm_ms = sum(g.flops / (RATES["bf16"] * 1e12) * 1e3 for g in work.gemms(config(FP8), 128))
    assert bound.by_category()["gemm"] == pytest.approx(gemm_ms)
    fc1 = next(t for t in bound.terms if t.name == "linear_fc1 fprop fp8")
    assert fc1.detail.endswith("at 100 TFLOP/s (bf16 probe)")
    with pytest.raises(perf.ProbeError, match="no kernel for this$"):
        perf.lower_bound(config(FP8), probes(FakeDevice(fail=("hbm",))), log=lambda line: None)


def test_kernel_names_fall_in_the_bounds_categories():
    names = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": "attention",
        "void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel<__nv_fp8_e4m3>": "norm",
        "void transformer_engine::detail::cast_transpose_kernel<__nv_fp8_e5m2>": "cast/transpose",
        "void transformer_engine::dgated_act_kernel<silu, __nv_fp8_e5m2>": "activation",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
        "Memcpy DtoD (Device -> Device)": "copy",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float>>": "optimizer",
        # the gradient norm and the gradient buffers' zeroing, which the bound counts with the step
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<c10::BFloat16, 2>>": "optimizer",
        "void at::native::(anonymous namespace)::lpnorm_cleanup<float, 2, float, float>": "optimizer",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>>": "optimizer",
        "_adamw_kernel": "optimizer",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "elementwise",
        # FSDP2's reduce-scatter packing and all-gather unpacking
        "void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<float, float>": "fsdp",
        "void at::native::split_with_sizes_copy_out_contiguous_no_cast_kernel<c10::BFloat16>": "fsdp",
    }
    assert {name: perf.kernel_category(name) for name in names} == names


def test_tables_put_bound_beside_measurement():
    bound = perf.Bound(
        [
            perf.Term("gemm", "linear fprop", 60.0, ""),
            perf.Term("attention", "attention", 20.0, ""),
            perf.Term("norm", "norm", 5.0, ""),
        ]
    )
    profile = {"gemm": 70.0, "attention": 45.0, "norm": 5.0, "copy": 2.0, perf.IDLE: 8.0}
    rows = [
        perf.Row("llama-1b", "te-delayed+graphs", "1gpu", bound, 100.0, profile),
        perf.Row("llama-1b", "te-bf16", "1gpu", None, None, None, ["run failed: out of memory"]),
    ]
    lines = perf.bound_table(rows).splitlines()
    assert lines[2] == (
        "| llama-1b | te-delayed+graphs | 1gpu | 85.0 | 100.0 | 1.18x | attention +25.0, gemm +10.0, GPU idle +8.0 |"
    )
    assert lines[3] == "| llama-1b | te-bf16 | 1gpu | - | - | - | run failed: out of memory |"
    table = perf.category_table(rows[0])
    assert "| attention | 20.0 | 45.0 | +25.0 |" in table and "| copy | 0.0 | 2.0 | +2.0 |" in table
    assert "| GPU idle | 0.0 | 8.0 | +8.0 |" in table and "| rope |" not in table
    without_norm = perf.Row("p", "c", "1gpu", bound, 100.0, {"gemm": 70.0})
    assert "| norm | 5.0 | 0.0 | -5.0 |" in perf.category_table(without_norm)
    assert perf.terms_table(bound).splitlines()[2].startswith("| gemm | linear fprop | 60.00 |")


def test_attention_probes_fall_back_from_fp8_to_bf16_and_from_te_to_sdpa():
    cfg = config(FP8)
    cfg.model.transformer_impl = "transformer_engine"  # TE settings, set after parsing on this CPU
    cfg.precision.fp8_dot_product_attention = True
    assert [(a.fp8, a.count) for a in work.attention(cfg)] == [(True, 2), (False, 2)]  # the first layer in bf16
    lines = []
    device = FakeDevice(fail=("attention_te",))
    bound = perf.lower_bound(cfg, probes(device), log=lines.append)
    assert [line.split(":")[0] for line in lines] == [
        "FP8 attention probe failed, bf16 attention used instead",
        "Transformer Engine attention probe failed, torch SDPA used",
    ]
    assert {kind for kind, _ in device.calls if kind.startswith("attention")} == {"attention_te", "attention_sdpa"}
    assert bound.by_category()["attention"] == pytest.approx(4 * ATTENTION[1])


# FSDP on 2 ranks, 2 micro-batches each (global batch 8). The tiny model's units: embedding 128 x 64 = 8192, two
# layers of 36864 linear weights + 2 norm weights = 36992, the output unit: final norm + output layer = 64 + 8192.
FSDP = " --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --global-batch-size 8"
OPTIM_GRADS = FSDP.replace("optim_grads_params", "optim_grads").replace("--use-megatron-fsdp", "--use-torch-fsdp2")
EMB, LAYER, LINEARS, OUT = 8192, 36992, 36864, 8256
P = EMB + 2 * LAYER + OUT
OUT_NAME = "output (final norm, output layer)"
NO_RESHARD = " --torch-fsdp2-no-reshard-after-forward"


def fsdp_config(extra: str = "", tied: bool = False):
    base = TINY.replace(" --untie-embeddings-and-output-weights", "") if tied else TINY
    return parse_args((base + extra).split(), world_size=2)


def memory_by_name(cfg) -> dict[str, float]:
    """name -> bytes per iteration."""
    return {w.name: w.total_bytes for w in traffic.memory_traffic(cfg, 128)}


def test_fsdp_units_follow_the_trainers_grouping():
    torch = pytest.importorskip("torch")
    from megatron.parallel.fsdp.fsdp2 import fsdp_units as module_units

    layers = [torch.nn.Linear(3, 2) for _ in range(5)]  # 8 parameters each
    for unit_size in (None, 1, 8, 9, 16, 17, 40, 100):
        expected = [len(unit) for unit in module_units(layers, unit_size)]
        assert fsdp_layer_units(5, 8, unit_size) == expected, unit_size
    units = fsdp.fsdp_units(fsdp_config(FSDP + " --suggested-communication-unit-size 40000"), 128)
    assert [(u.name, u.elements, u.fp8_elements, u.gathers) for u in units] == [
        ("embedding", EMB, 0, 4),  # gathered before each forward and each backward, 2 micro-batches
        ("layers 1-2", 2 * LAYER, 0, 2),  # 36992 < 40000 elements: both layers in one unit, the last: kept
        (OUT_NAME, OUT, 0, 2),  # kept gathered from its forward to its backward
    ]
    assert sum(u.elements for u in units) == P == work.param_count(fsdp_config(FSDP), 128)[0]
    grads = fsdp.fsdp_units(fsdp_config(OPTIM_GRADS), 128)
    assert [(u.name, u.gathers) for u in grads] == [("embedding", 1), ("layer 1", 1), ("layer 2", 1), (OUT_NAME, 1)]
    # --torch-fsdp2-no-reshard-after-forward: every unit once per micro-batch, the whole step's copy-ins halved for
    # the layers but the last; what nothing overlaps (the first unit's gather) unchanged
    no_reshard = fsdp_config(FSDP.replace("--use-megatron-fsdp", "--use-torch-fsdp2") + NO_RESHARD)
    kept = fsdp.fsdp_units(no_reshard, 128)
    assert [(u.name, u.gathers) for u in kept] == [("embedding", 2), ("layer 1", 2), ("layer 2", 2), (OUT_NAME, 2)]
    items, base = memory_by_name(no_reshard), memory_by_name(fsdp_config(FSDP))
    assert items["FSDP all-gather copy-in [embedding]"] == base["FSDP all-gather copy-in [embedding]"] / 2
    layers = "[2 units like layer 1]"  # alike now (the last layer unit was gathered half as often)
    for name in ("FSDP all-gather copy-in", "FSDP all-gather copy-out"):  # 2 units x 2 gathers, 4 before
        assert items[f"{name} {layers}"] == 2 * base[f"{name} [layer 1]"] / 2 == 2 * base[f"{name} [layer 2]"]
    assert items[f"FSDP reduce-scatter staging {layers}"] == 2 * base["FSDP reduce-scatter staging [layer 1]"]
    assert fsdp.fsdp_communication(no_reshard, 128) == fsdp.fsdp_communication(fsdp_config(FSDP), 128)
    tied = fsdp.fsdp_units(fsdp_config(FSDP, tied=True), 128)
    assert [(u.name, u.elements, u.gathers) for u in tied] == [
        ("root (embedding, final norm)", EMB + 64, 2),
        ("layer 1", LAYER, 4),
        ("layer 2", LAYER, 2),  # the last layer unit stays gathered from its forward to its backward
    ]


def test_fsdp_memory_of_a_tiny_model_by_hand():
    cfg = fsdp_config(FSDP)
    plain = memory_by_name(config(" --global-batch-size 8", world_size=2))  # the same model under plain DP
    items = memory_by_name(cfg)
    # b = 2 (bf16 gathers), s = 4 (fp32 shards), g = 4 (fp32 gradient shards), r = 4 (fp32 reduce-scatters)
    layer = "[layer 1]"
    assert items[f"FSDP all-gather copy-in {layer}"] == 4 * (4 + 2) * LAYER / 2  # 4 gathers, over 2 ranks
    assert items["FSDP all-gather copy-in [layer 2]"] == 2 * (4 + 2) * LAYER / 2  # the last: kept for its backward
    assert items["FSDP all-gather copy-in [embedding]"] == 4 * (4 + 2) * EMB / 2
    assert items[f"FSDP all-gather copy-in [{OUT_NAME}]"] == 2 * (4 + 2) * OUT / 2
    assert items[f"FSDP all-gather copy-out {layer}"] == 4 * 2 * 2 * LAYER  # read + write the bf16 unit
    assert items[f"FSDP reduce-scatter staging {layer}"] == 2 * (2 + 4) * LAYER  # per micro-batch: bf16 -> fp32
    assert items[f"FSDP gradient shard add {layer}"] == 2 * (4 + 2 * 4) * LAYER / 2
    assert items["Adam step + grad zero + grad norm (FSDP shards)"] == (8 + 8 + 8 + 12) * P / 2
    fsdp_names = {n for n in items if n.startswith("FSDP") or "FSDP" in n}
    assert len(fsdp_names) == 4 * 4 + 1  # four passes of four units, and the optimizer
    # everything else is the plain data-parallel row's, less its optimizer (38 bytes per parameter, unsharded), but
    # the embedding's backward scatter-adds into the bf16 unsharded gradient rows (6Th, not 10Th into fp32)
    rest = {n: v for n, v in items.items() if n not in fsdp_names}
    assert rest.pop("embedding bwd") == 2 * 6 * 64 * 64 == plain["embedding bwd"] * 6 / 10
    assert rest == {n: v for n, v in plain.items() if not n.startswith("Adam") and n != "embedding bwd"}
    gathers = 4 * EMB + 4 * LAYER + 2 * LAYER + 2 * OUT
    total = 3 * gathers + 4 * gathers + (12 + 12) * P + 18 * P  # copy-in, copy-out, reduce-scatter + add, Adam
    assert sum(items[n] for n in fsdp_names) == total
    # optim_grads: one gather per step, the same reduce-scatters
    once = memory_by_name(fsdp_config(OPTIM_GRADS))
    assert once["FSDP all-gather copy-in [2 units like layer 1]"] == 2 * (4 + 2) * LAYER / 2
    assert once["FSDP all-gather copy-out [embedding]"] == 2 * 2 * EMB
    staging = items["FSDP reduce-scatter staging [layer 1]"] + items["FSDP reduce-scatter staging [layer 2]"]
    assert once["FSDP reduce-scatter staging [2 units like layer 1]"] == staging


def test_fsdp_gradient_and_state_dtypes():
    bf16comm = memory_by_name(fsdp_config(FSDP + " --megatron-fsdp-grad-comm-dtype bf16"))
    assert bf16comm["FSDP reduce-scatter staging [layer 1]"] == 2 * (2 + 2) * LAYER
    assert bf16comm["FSDP gradient shard add [layer 1]"] == 2 * (2 + 8) * LAYER / 2
    o2 = " --megatron-fsdp-main-grads-dtype bf16 --use-precision-aware-optimizer --main-params-dtype fp16"
    o2 += " --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16"
    states = memory_by_name(fsdp_config(FSDP + o2))
    # bf16 shards: copy-in reads 2 bytes; Adam: fp16 main weights, FP8 / fp16 moments, bf16 gradient shards, and
    # the bf16 shard written from the main weights
    assert states["FSDP all-gather copy-in [embedding]"] == 4 * (2 + 2) * EMB / 2
    assert states["Adam step + grad zero + grad norm (FSDP shards)"] == (4 + 2 + 4 + 6 + 2) * P / 2
    fp8comm = memory_by_name(fsdp_config(FP8 + FSDP + " --fp8-grad-reduce"))
    assert fp8comm["FSDP reduce-scatter staging + FP8 cast [embedding]"] == 2 * (2 + 1) * EMB
    assert fp8comm["FSDP FP8 reduce-scatter dequantize-sum [embedding]"] == 2 * (EMB + 4 * EMB / 2)
    assert "FSDP reduce-scatter staging [embedding]" not in fp8comm


def test_fsdp_fp8_gathers_halve_the_linear_weights_bytes():
    bf16 = memory_by_name(fsdp_config(FP8 + FSDP))
    fp8 = memory_by_name(fsdp_config(FP8 + FSDP + " --fp8-param-gather"))
    # the second layer is FP8 (the first stays bf16): its 36864 linear weights are gathered as 1 byte, not 2; the
    # second (last) layer is gathered twice per step, the first four times
    assert fp8["FSDP all-gather copy-out [layer 2]"] == 2 * 2 * (2 * (LAYER - LINEARS) + LINEARS)
    assert fp8["FSDP all-gather copy-out [layer 1]"] == 4 * 2 * 2 * LAYER
    assert (fp8["FSDP all-gather copy-out [layer 2]"] / 2) / (fp8["FSDP all-gather copy-out [layer 1]"] / 4) < 0.51
    assert fp8["FSDP all-gather copy-in [layer 2]"] == 2 * (4 * (LAYER - LINEARS) + LINEARS + 2 * 128 + LINEARS) / 2
    # the cached shard: amax and cast once per step; the dgrad's transposed weight at each backward gather
    assert fp8["FP8 shard amax + cast (FSDP)"] == (2 * 4 + 1) * LINEARS / 2
    assert fp8["FP8 weight transpose (FSDP, dgrad)"] == 2 * 2 * LINEARS
    assert "FP8 weight casts (FSDP, per micro-batch)" not in fp8
    # bf16 gathers: the local linears cast the gathered weight every micro-batch (rows + transpose); TE in the forward
    # and again in the backward
    assert bf16["FP8 weight casts (FSDP, per micro-batch)"] == 2 * (2 + 2) * LINEARS
    te = fsdp_config(FP8 + FSDP)
    te.model.transformer_impl = "transformer_engine"  # (a GPU setting: set after parsing on this CPU)
    assert memory_by_name(te)["FP8 weight casts (FSDP, per micro-batch)"] == 2 * 2 * (2 + 1) * LINEARS
    once = memory_by_name(fsdp_config(FP8 + OPTIM_GRADS + " --fp8-param-gather"))
    assert once["FP8 weight transpose (FSDP, dgrad)"] == 2 * LINEARS  # the gathered weight kept for the step
    # bf16 gathers under optim_grads: the weights stay gathered for the step, and both the local linears and TE's
    # cast them once per step (rows + transpose) and keep the cast, as under the distributed optimizer
    for impl in ("local", "transformer_engine"):
        cfg = fsdp_config(FP8 + OPTIM_GRADS)
        cfg.model.transformer_impl = impl
        kept = memory_by_name(cfg)
        assert kept["FP8 weight casts (FSDP, once per step)"] == (2 + 2) * LINEARS, impl
        assert "FP8 weight casts (FSDP, per micro-batch)" not in kept, impl


def test_fsdp_communication_that_cannot_overlap():
    cfg = fsdp_config(FSDP)
    assert [(c.name, c.op, c.nbytes, c.ranks, c.count) for c in traffic.communication(cfg, 128)] == [
        ("FSDP all-gather of the first unit (embedding)", "all_gather", 2 * EMB, 2, 2),  # each micro-batch
        ("FSDP reduce-scatter of the last unit (embedding)", "reduce_scatter", 4 * EMB, 2, 2),
    ]
    bound = perf.lower_bound(cfg, probes(), log=lambda line: None)
    assert bound.by_category()["communication"] == pytest.approx((2 * 2 * EMB + 2 * 4 * EMB) / 2 / (BUS * 1e9) * 1e3)
    assert bound.by_category()["fsdp"] > 0
    [gather, reduce] = traffic.communication(fsdp_config(OPTIM_GRADS), 128)
    assert (gather.count, reduce.count) == (1, 2)  # one gather per step, a reduce-scatter per micro-batch
    [_, fp8] = traffic.communication(fsdp_config(FP8 + FSDP + " --fp8-grad-reduce"), 128)
    assert (fp8.op, fp8.nbytes) == ("reduce_scatter", 8256)  # e4m3 bytes and a scale per 128 values
    [gather, reduce] = traffic.communication(fsdp_config(FSDP + " --megatron-fsdp-grad-comm-dtype bf16", True), 128)
    assert (gather.nbytes, reduce.nbytes, gather.count) == (2 * (EMB + 64), 2 * (EMB + 64), 2)  # the root


# The bound of rows without FSDP, computed on main (9eb4f12) before FSDP's terms, plus RoPE's copy of v (2 x 4K bytes
# per layer and micro-batch, counted since the fused kernel): (flags, ranks, memory bytes, ms)
UNCHANGED = {
    "bf16": ("", 1, 5238656.0, 8.005867801599997),
    "fp8": (FP8, 1, 5451648.0, 8.00593923584),
    "fp8params_distopt_dp2": (
        FP8 + " --fp8-param-gather --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
        " --global-batch-size 8",
        2,
        3822144.0,
        8.00936701184,
    ),
    "dp2_o2": (
        FP8 + " --fp8-param-gather --fp8-optimizer-level O2 --use-distributed-optimizer --global-batch-size 8",
        2,
        2827392.0,
        8.00565929984,
    ),
    "tp2_sp": (
        FP8 + " --tensor-model-parallel-size 2 --sequence-parallel --recompute-activations",
        2,
        2789248.0,
        10.006374067200003,
    ),
    "no_shard_dp2": (
        " --use-megatron-fsdp --data-parallel-sharding-strategy no_shard --global-batch-size 8",
        2,
        5238656.0,
        8.013102361599998,
    ),
    "optim_dp2": (
        " --use-megatron-fsdp --data-parallel-sharding-strategy optim --global-batch-size 8",
        2,
        3701312.0,
        8.009756377599999,
    ),
}


@pytest.mark.parametrize("name", UNCHANGED)
def test_rows_without_fsdp_keep_their_bound_bit_for_bit(name):
    extra, ranks, memory, ms = UNCHANGED[name]
    cfg = config(extra, world_size=ranks)
    assert sum(w.total_bytes for w in traffic.memory_traffic(cfg, 128)) == memory
    bound = perf.lower_bound(cfg, probes(), log=lambda line: None)
    assert bound.total_ms == ms and bound.by_category()["fsdp"] == 0
