"""The Transformer Engine backend's CPU-side logic: default implementation choice, recipe mapping (against a
stand-in for `transformer_engine.common.recipe`), startup errors, and checkpoint keys across implementations."""

import enum
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch

from megatron.config import ConfigError, parse_args, te_rules
from megatron.fp8 import te_recipe
from megatron.fp8.te_recipe import check_fp8_attention_on_gpu, check_recipe_on_gpu
from megatron.model import GPTModel

BASE = "--mock-data --vocab-size 128 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32"


class _Format(enum.Enum):
    E4M3 = "E4M3"
    HYBRID = "HYBRID"


@dataclass(frozen=True)
class _QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0


@dataclass
class _DelayedScaling:
    fp8_format: Any = _Format.HYBRID
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"


@dataclass
class _CurrentScaling:
    fp8_format: Any = _Format.HYBRID


@dataclass
class _BlockScaling:
    fp8_format: Any = _Format.E4M3
    fp8_quant_fwd_inp: Any = _QParams(power_2_scale=True)
    fp8_quant_fwd_weight: Any = _QParams(power_2_scale=True)
    fp8_quant_bwd_grad: Any = _QParams(power_2_scale=True)


@dataclass
class _MXFP8:
    fp8_format: Any = _Format.E4M3


class _OverrideLinearPrecision(NamedTuple):
    fprop: bool = False
    dgrad: bool = False
    wgrad: bool = False


@dataclass
class _OldDelayedScaling(_DelayedScaling):
    override_linear_precision: Any = _OverrideLinearPrecision()


TE2 = SimpleNamespace(
    Format=_Format,
    QParams=_QParams,
    DelayedScaling=_DelayedScaling,
    Float8CurrentScaling=_CurrentScaling,
    Float8BlockScaling=_BlockScaling,
    MXFP8BlockScaling=_MXFP8,
)
"""Like TE 2.20: no override_linear_precision."""
TE1 = SimpleNamespace(
    **{**vars(TE2), "DelayedScaling": _OldDelayedScaling}, _OverrideLinearPrecision=_OverrideLinearPrecision
)
"""Like earlier TE releases, whose recipes took override_linear_precision."""


def parse(extra: str = "", **kwargs):
    return parse_args(f"{BASE} {extra}".split(), **kwargs)


@pytest.fixture
def te_present(monkeypatch):
    """Pretend Transformer Engine imports (the config only asks te_import_error)."""
    monkeypatch.setattr(te_rules, "te_import_error", lambda: None)


def test_default_impl_is_local_without_cuda_and_says_so():
    cfg = parse()
    assert cfg.model.transformer_impl == "local"
    assert any("--transformer-impl local (no CUDA device)" in n for n in cfg.notes)


def test_default_impl_on_cuda_depends_on_te(monkeypatch, te_present):
    cfg = parse(device_type="cuda")
    assert cfg.model.transformer_impl == "transformer_engine"
    assert cfg.finalize().model.transformer_impl == "transformer_engine"  # idempotent
    # rowwise has no TE recipe: the default picks the local engine instead of failing
    rowwise = parse("--fp8-format hybrid --fp8-recipe rowwise", device_type="cuda")
    assert rowwise.model.transformer_impl == "local" and any("rowwise" in n for n in rowwise.notes)
    monkeypatch.setattr(te_rules, "te_import_error", lambda: "ModuleNotFoundError: No module named 'x'")
    cfg = parse(device_type="cuda")
    assert cfg.model.transformer_impl == "local"
    assert any("Transformer Engine does not import" in n for n in cfg.notes)


@pytest.mark.parametrize(
    "extra, device, te, expected",
    [
        ("--transformer-impl transformer_engine", "cpu", True, "needs a CUDA GPU; use --transformer-impl local"),
        ("--transformer-impl transformer_engine", "cuda", False, "does not import"),
        (
            "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe rowwise",
            "cuda",
            True,
            "--fp8-recipe rowwise has no Transformer Engine recipe; use --transformer-impl local",
        ),
        (
            "--transformer-impl transformer_engine --fp8-format e4m3 --micro-batch-size 1 --seq-length 36",
            "cuda",
            True,
            "is 36; change --seq-length",
        ),
        (
            "--transformer-impl transformer_engine --fp8-format e4m3 --hidden-size 72 --num-attention-heads 4",
            "cuda",
            True,
            "--hidden-size is 72; change --hidden-size",
        ),
        ("--transformer-impl transformer_engine --fp8-format e4m3 --ffn-hidden-size 100", "cuda", True, "--ffn"),
        (
            "--transformer-impl transformer_engine --fp8-format e4m3 --fp8-recipe mxfp8 --ffn-hidden-size 240",
            "cuda",
            True,
            "multiples of 32: --ffn-hidden-size is 240",
        ),
        (  # ffn 32 fits, but each of 4 tensor-parallel ranks' GEMMs sees a quarter of it
            "--transformer-impl transformer_engine --fp8-format e4m3 --ffn-hidden-size 32"
            " --tensor-model-parallel-size 4",
            "cuda",
            True,
            "--ffn-hidden-size / tensor-parallel size is 8; change --ffn-hidden-size",
        ),
        (  # sequence parallelism quantizes each rank's sequence shard: 1 x 32 / 4 = 8 tokens
            "--transformer-impl transformer_engine --fp8-format e4m3 --micro-batch-size 1 --ffn-hidden-size 64"
            " --tensor-model-parallel-size 4 --sequence-parallel",
            "cuda",
            True,
            "--seq-length / tensor-parallel size is 8; change --seq-length",
        ),
    ],
)
def test_startup_errors_are_one_line_naming_the_flag(monkeypatch, extra, device, te, expected):
    monkeypatch.setattr(te_rules, "te_import_error", lambda: None if te else "ImportError: no TE here")
    with pytest.raises(ConfigError) as info:
        parse(extra, device_type=device, world_size=4 if "parallel-size 4" in extra else 1)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_fp8_shapes_that_fit_pass(te_present):
    cfg = parse("--transformer-impl transformer_engine --fp8-format hybrid --micro-batch-size 1", device_type="cuda")
    assert cfg.model.transformer_impl == "transformer_engine" and cfg.precision.bf16


def test_te_takes_every_parallel_layout(te_present):
    layout = "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"
    cfg = parse(f"--transformer-impl transformer_engine --fp8-format hybrid {layout}", world_size=8, device_type="cuda")
    assert cfg.model.transformer_impl == "transformer_engine"
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) == (2, 2)


def test_recipe_mapping():
    delayed = te_recipe.te_recipe(
        parse(
            "--fp8-format hybrid --fp8-recipe delayed --fp8-margin 1 --fp8-amax-history-len 16"
            " --fp8-amax-compute-algo max"
        ).precision,
        TE2,
    )
    assert delayed == _DelayedScaling(_Format.HYBRID, margin=1, amax_history_len=16, amax_compute_algo="max")
    assert te_recipe.te_recipe(parse("--fp8-format e4m3 --fp8-recipe tensorwise").precision, TE2) == _CurrentScaling(
        _Format.E4M3
    )
    block = te_recipe.te_recipe(parse("--fp8-format e4m3 --fp8-recipe blockwise").precision, TE2)
    assert isinstance(block, _BlockScaling) and block.fp8_quant_fwd_weight.power_2_scale
    fp32 = te_recipe.te_recipe(
        parse("--fp8-format e4m3 --fp8-recipe blockwise --fp8-blockwise-fp32-scales").precision, TE2
    )
    assert not any(
        q.power_2_scale for q in (fp32.fp8_quant_fwd_inp, fp32.fp8_quant_fwd_weight, fp32.fp8_quant_bwd_grad)
    )
    assert te_recipe.te_recipe(parse("--fp8-format hybrid --fp8-recipe mxfp8").precision, TE2) == _MXFP8(_Format.HYBRID)
    with pytest.raises(ConfigError, match="--transformer-impl local"):
        te_recipe.te_recipe(parse("--fp8-format hybrid --fp8-recipe rowwise").precision, TE2)


def test_no_fp8_wgrad_maps_to_override_or_is_refused():
    precision = parse("--fp8-format hybrid --no-fp8-wgrad").precision
    old = te_recipe.te_recipe(precision, TE1)
    assert old.override_linear_precision == _OverrideLinearPrecision(fprop=False, dgrad=False, wgrad=True)
    with pytest.raises(ConfigError, match="--no-fp8-wgrad.*--transformer-impl local"):
        te_recipe.te_recipe(precision, TE2)


def test_gpu_capability_check_names_gpu_recipe_and_alternative():
    with pytest.raises(ConfigError) as info:
        check_recipe_on_gpu("mxfp8", (9, 0), "NVIDIA H100 80GB HBM3")
    message = str(info.value)
    for part in ("--fp8-recipe mxfp8", "10.0", "NVIDIA H100 80GB HBM3", "is 9.0", "--fp8-recipe blockwise", "local"):
        assert part in message
    check_recipe_on_gpu("mxfp8", (10, 0), "NVIDIA B200")
    check_recipe_on_gpu("blockwise", (9, 0), "NVIDIA H100", "13.0")
    with pytest.raises(ConfigError, match="CUDA >= 12.9"):
        check_recipe_on_gpu("blockwise", (9, 0), "NVIDIA H100", "12.4")
    with pytest.raises(ConfigError, match="8.9.*NVIDIA A100.*--transformer-impl local"):
        check_recipe_on_gpu("delayed", (8, 0), "NVIDIA A100")
    check_recipe_on_gpu("tensorwise", (8, 9), "NVIDIA L40S")


def test_local_model_loads_a_state_dict_with_te_extra_state():
    cfg = parse()
    torch.manual_seed(0)
    source = GPTModel(cfg.model, 128)
    state = source.state_dict()
    state["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.zeros(0, dtype=torch.uint8)
    state["decoder.layers.1.self_attention.core_attention._extra_state"] = None
    torch.manual_seed(1)
    target = GPTModel(cfg.model, 128)
    target.load_state_dict(state)  # strict: only the TE extra state is dropped
    tokens = torch.randint(0, 128, (2, 32))
    torch.testing.assert_close(target.eval()(tokens), source.eval()(tokens), rtol=0, atol=0)
    del state["decoder.layers.0.mlp.linear_fc2.weight"]
    with pytest.raises(RuntimeError, match="linear_fc2.weight"):
        target.load_state_dict(state)


@pytest.mark.parametrize(
    "extra, expected",
    [
        ("--fp8-param-gather", "--fp8-param-gather needs FP8 on"),
        (
            "--fp8-param-gather --fp8-format hybrid --fp8-recipe rowwise --transformer-impl local",
            "the local engine keeps FP8 weights with one scale per tensor .* --transformer-impl transformer_engine",
        ),
    ],
)
def test_fp8_param_gather_needs_fp8_and_a_recipe_with_fp8_weights(te_present, extra, expected):
    with pytest.raises(ConfigError, match=expected):
        parse(extra, device_type="cuda")
    cfg = parse("--fp8-param-gather --fp8-format hybrid --transformer-impl transformer_engine", device_type="cuda")
    assert cfg.precision.fp8_param_gather


@pytest.mark.parametrize(
    "extra, expected",
    [
        ("--transformer-impl local", "graphs Transformer Engine layers; add --transformer-impl transformer_engine"),
        ("--pipeline-model-parallel-size 2", "needs --pipeline-model-parallel-size 1"),
        ("--reset-position-ids", "drop --reset-position-ids or the CUDA graphs"),
        ("--reset-attention-mask", "drop --reset-attention-mask or the CUDA graphs"),
        ("--fp8-format hybrid --fp8-stats-interval 10", "--fp8-stats-interval observes the layers through hooks"),
        (
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
            "--cuda-graph-impl transformer_engine with --recompute-granularity",
        ),
        ("--recompute-activations", "--cuda-graph-impl transformer_engine with --recompute-granularity"),
    ],
)
def test_cuda_graphs_need_te_one_stage_and_fixed_shapes(te_present, extra, expected):
    graphs = "--cuda-graph-impl transformer_engine"
    if "local" not in extra:
        extra += " --transformer-impl transformer_engine"
    with pytest.raises(ConfigError) as info:
        parse(f"{graphs} {extra}", device_type="cuda", world_size=2)
    assert expected in str(info.value) and "\n" not in str(info.value)
    cfg = parse(
        f"{graphs} --transformer-impl transformer_engine --tensor-model-parallel-size 2",
        world_size=2,
        device_type="cuda",
    )
    assert cfg.training.cuda_graph_impl == "transformer_engine"
    with pytest.raises(ConfigError, match="invalid choice: 'local'"):  # Megatron-Core's own graphs: not offered
        parse("--cuda-graph-impl local")


@pytest.mark.parametrize(
    "extra, expected",
    [
        ("--transformer-impl transformer_engine", "--fp8-dot-product-attention needs FP8 on"),
        (
            "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe tensorwise",
            "--fp8-dot-product-attention needs --fp8-recipe delayed (got tensorwise)",
        ),
        ("--transformer-impl local --fp8-format hybrid", "--fp8-dot-product-attention needs --transformer-impl"),
    ],
)
def test_fp8_attention_needs_te_and_delayed_scaling(te_present, extra, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse(f"--fp8-dot-product-attention {extra}", device_type="cuda")
    cfg = parse(
        "--fp8-dot-product-attention --fp8-format hybrid --transformer-impl transformer_engine", device_type="cuda"
    )
    assert cfg.precision.fp8_dot_product_attention


def test_fp8_attention_maps_to_fp8_dpa(te_present):
    @dataclass
    class DelayedWithDpa(_DelayedScaling):
        fp8_dpa: bool = False

    module = SimpleNamespace(**{**vars(TE2), "DelayedScaling": DelayedWithDpa})
    te = "--transformer-impl transformer_engine --fp8-format hybrid"
    cfg = parse(f"{te} --fp8-dot-product-attention", device_type="cuda")
    assert te_recipe.te_recipe(cfg.precision, module).fp8_dpa
    assert not te_recipe.te_recipe(parse(te, device_type="cuda").precision, module).fp8_dpa


def test_fp8_attention_head_size_on_hopper():
    check_fp8_attention_on_gpu(128, (9, 0), "NVIDIA H100")
    check_fp8_attention_on_gpu(64, (10, 0), "NVIDIA B200")
    with pytest.raises(ConfigError, match=r"needs a head size of 128 .* \(--kv-channels\) is 64: drop the flag"):
        check_fp8_attention_on_gpu(64, (9, 0), "NVIDIA H100")


@pytest.mark.parametrize(
    "extra, expected",
    [
        ("--transformer-impl transformer_engine", "--tp-comm-overlap overlaps the sequence-parallel collectives"),
        ("--transformer-impl local --sequence-parallel", "add --transformer-impl transformer_engine or drop the flag"),
        (
            "--transformer-impl transformer_engine --sequence-parallel --fp8-format e4m3 --fp8-recipe blockwise",
            "gather per-tensor or MXFP8 FP8 data only; use --fp8-recipe delayed or tensorwise",
        ),
    ],
)
def test_tp_comm_overlap_needs_te_sequence_parallel_and_a_gatherable_recipe(te_present, extra, expected):
    layout = "--tp-comm-overlap --tensor-model-parallel-size 2"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse(f"{layout} {extra}", device_type="cuda", world_size=2)
    te_sp = "--transformer-impl transformer_engine --sequence-parallel --fp8-format hybrid"
    cfg = parse(f"{layout} {te_sp}", device_type="cuda", world_size=2)
    assert cfg.parallel.tp_comm_overlap and cfg.parallel.tp_comm_bootstrap_backend == "nccl"


def test_tp_comm_overlap_notes_cuda_device_max_connections(te_present, monkeypatch):
    flags = "--tp-comm-overlap --tensor-model-parallel-size 2 --sequence-parallel --transformer-impl transformer_engine"
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert any("CUDA_DEVICE_MAX_CONNECTIONS=1" in n for n in parse(flags, device_type="cuda", world_size=2).notes)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert not any("CUDA_DEVICE_MAX_CONNECTIONS" in n for n in parse(flags, device_type="cuda", world_size=2).notes)


def test_distributed_optimizer_gathers_te_fp8_weights_of_the_recipes_that_have_them(te_present):
    flags = "--use-distributed-optimizer --transformer-impl transformer_engine --fp8-param-gather"
    for recipe, fmt in (("delayed", "hybrid"), ("tensorwise", "hybrid"), ("blockwise", "e4m3")):
        cfg = parse(f"{flags} --fp8-format {fmt} --fp8-recipe {recipe}", device_type="cuda", world_size=2)
        assert cfg.precision.fp8_param_gather and cfg.optimizer.use_distributed_optimizer
    with pytest.raises(ConfigError, match="mxfp8 weights cannot be all-gathered as FP8 bytes; use --fp8-recipe"):
        parse(f"{flags} --fp8-format e4m3 --fp8-recipe mxfp8", device_type="cuda", world_size=2)
    # under FSDP too (the local layers gather every recipe: tests/unit/test_fsdp_flags.py)
    fsdp = "--use-megatron-fsdp --bf16 --transformer-impl transformer_engine --fp8-param-gather --fp8-format e4m3"
    with pytest.raises(ConfigError, match="FSDP and --fp8-recipe mxfp8: Transformer Engine's mxfp8 weights cannot"):
        parse(f"{fsdp} --fp8-recipe mxfp8", device_type="cuda", world_size=2)
    assert parse(f"{fsdp} --fp8-recipe blockwise", device_type="cuda", world_size=2).precision.fp8_param_gather
    with pytest.raises(ConfigError, match="rebuilds the weights' transposes outside the captured graphs"):
        parse(f"{flags} --fp8-format hybrid --cuda-graph-impl transformer_engine", device_type="cuda", world_size=2)
    assert parse(f"{flags} --fp8-format hybrid --cuda-graph-impl transformer_engine", device_type="cuda")


def test_tp_only_amax_reduction_is_a_transformer_engine_flag(te_present):
    with pytest.raises(ConfigError, match="--tp-only-amax-red applies to Transformer Engine's amax reductions"):
        parse("--tp-only-amax-red --transformer-impl local --fp8-format hybrid", device_type="cuda", world_size=2)
    cfg = parse("--tp-only-amax-red --transformer-impl transformer_engine --fp8-format hybrid", device_type="cuda")
    assert cfg.precision.tp_only_amax_red


def _te_linear_stand_in(parallel_mode: str, device: str) -> torch.nn.Module:
    """A TE linear as `te_linear` builds it (weight, bias, fused norm weight), marked as TE marks its parameters when
    it initializes them on a real device (TE 2.x `reset_parameters`), unmarked on the meta device (initialization
    deferred)."""
    module = torch.nn.Module()
    module.parallel_mode, module.use_bias = parallel_mode, True
    module.weight = torch.nn.Parameter(torch.empty(8, 4, device=device))
    module.bias = torch.nn.Parameter(torch.empty(8, device=device))
    module.layer_norm_weight = torch.nn.Parameter(torch.empty(4, device=device))
    if device != "meta":
        dim = 1 if parallel_mode == "row" else 0
        for param in [module.weight] + ([module.bias] if dim == 0 else []):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
        for param in [module.layer_norm_weight] + ([module.bias] if dim == 1 else []):
            param.sequence_parallel = True
    return module


@pytest.mark.parametrize("parallel_mode", ["column", "row"])
def test_te_params_built_on_the_meta_device_are_marked_as_when_built_eagerly(parallel_mode):
    """--init-model-with-meta-device: TE defers the marks it sets when initializing; `mark_te_params` sets them."""
    from megatron.model.te_linear import mark_te_params
    from megatron.parallel.tensor_parallel import TensorParallel

    tp = TensorParallel(size=2, rank=1, sequence_parallel=True)
    eager, meta = _te_linear_stand_in(parallel_mode, "cpu"), _te_linear_stand_in(parallel_mode, "meta")
    for module in (eager, meta):
        mark_te_params(module, tp, parts=2)
    for (name, a), b in zip(eager.named_parameters(), meta.parameters(), strict=True):
        assert vars(a) == vars(b), (name, vars(a), vars(b))
    assert meta.weight.tensor_model_parallel and meta.weight.partition_dim == (0 if parallel_mode == "column" else 1)
    assert meta.weight.partition_parts == (2 if parallel_mode == "column" else 1)
    assert meta.layer_norm_weight.grad_norm_duplicate and not hasattr(meta.layer_norm_weight, "partition_dim")
