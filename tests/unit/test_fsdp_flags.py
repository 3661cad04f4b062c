"""FSDP flags: the strategy they resolve to, and a one-line error naming the flags for every combination not built."""

import dataclasses

import pytest

from megatron.config import Config, ConfigError, parse_args
from megatron.config.sharding import check_meta_device_layers

BASE = "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16"


def parse(extra: str, world_size: int = 2):
    return parse_args(f"{BASE} {extra}".split(), world_size=world_size)


@pytest.mark.parametrize(
    "extra, strategy, distopt, engine",
    [
        ("", None, False, "buffers"),
        ("--use-megatron-fsdp", "optim_grads_params", False, "fsdp2"),  # Megatron-LM's default strategy
        ("--use-torch-fsdp2", "optim_grads_params", False, "fsdp2"),
        # the flat-buffer engine (parallel/fsdp/flat_shards.py) on the distributed optimizer's buckets and state
        ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads", "optim_grads", True, "flat_shards"),
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --use-distributed-optimizer",
            "optim_grads",
            True,
            "flat_shards",
        ),
        ("--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads", "optim_grads", False, "fsdp2"),
        (
            "--use-torch-fsdp2 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads",
            "optim_grads",
            False,
            "fsdp2",
        ),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy optim", "optim", True, "buffers"),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy no_shard", "no_shard", False, "buffers"),
    ],
)
def test_strategy_resolution(extra, strategy, distopt, engine):
    cfg = parse(extra)
    assert cfg.parallel.data_parallel_sharding_strategy == strategy
    assert cfg.sharding.engine == engine
    assert cfg.optimizer.use_distributed_optimizer == distopt
    assert cfg.finalize().parallel.data_parallel_sharding_strategy == strategy  # idempotent


FSDP = "--use-megatron-fsdp"
ZERO2 = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads"
TORCH = "--use-torch-fsdp2"
NO_RESHARD = "--torch-fsdp2-no-reshard-after-forward"


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        ("--data-parallel-sharding-strategy optim_grads", 2, "--data-parallel-sharding-strategy configure FSDP"),
        ("--fsdp-double-buffer --init-model-with-meta-device", 2, "--fsdp-double-buffer, --init-model-with-meta"),
        ("--megatron-fsdp-grad-comm-dtype bf16", 2, "--megatron-fsdp-grad-comm-dtype configure FSDP"),
        (f"{FSDP} --data-parallel-sharding-strategy optim --fsdp-double-buffer", 2, "--fsdp-double-buffer need"),
        (f"{FSDP} --data-parallel-sharding-strategy no_shard --use-distributed-optimizer", 2, "choose optim"),
        (f"{FSDP} --use-distributed-optimizer", 2, "drop --use-distributed-optimizer"),
        (FSDP, 1, "run at least two"),
        (f"{FSDP} --pipeline-model-parallel-size 2", 4, "--pipeline-model-parallel-size 2: not built yet"),
        (f"{FSDP} --tensor-model-parallel-size 2", 2, "run at least two"),  # no data-parallel ranks left
        (f"{FSDP} --fp16", 2, "--fp16: not built yet"),
        (
            f"{FSDP} --bf16 --use-precision-aware-optimizer --megatron-fsdp-main-params-dtype bf16",
            2,
            "--megatron-fsdp-main-params-dtype bf16 with --use-precision-aware-optimizer: the optimizer holds",
        ),
        (f"{FSDP} --bf16 --megatron-fsdp-main-params-dtype bf16", 2, "--megatron-fsdp-main-params-dtype bf16"),
        (f"{FSDP} --bf16 --megatron-fsdp-main-params-dtype auto", 2, "--megatron-fsdp-main-params-dtype auto"),
        (f"{FSDP} --megatron-fsdp-main-grads-dtype fp16", 2, "--megatron-fsdp-main-grads-dtype fp16"),
        (f"{FSDP} --megatron-fsdp-grad-comm-dtype fp16", 2, "--megatron-fsdp-grad-comm-dtype fp16"),
        (f"{FSDP} --save /tmp/x --ckpt-format torch", 2, "FSDP saves its shards with --ckpt-format torch_dist"),
        # --use-megatron-fsdp's optim_grads (parallel/fsdp/flat_shards.py)
        (f"{ZERO2}", 1, "optim_grads shards over the data-parallel ranks: run at least two"),
        (f"{ZERO2} --fsdp-double-buffer", 2, "--fsdp-double-buffer configure FSDP2's units: add --use-torch-fsdp2"),
        (
            f"{ZERO2} --pipeline-model-parallel-size 2",
            4,
            "optim_grads with --pipeline-model-parallel-size 2: not built",
        ),
        (f"{ZERO2} --bf16 --cuda-graph-impl transformer_engine", 2, "optim_grads with --cuda-graph-impl"),
        (f"{ZERO2} --fp16", 2, "optim_grads with --fp16: not built yet"),
        (f"{ZERO2} --megatron-fsdp-main-grads-dtype fp16", 2, "--megatron-fsdp-main-grads-dtype fp16"),
        (f"{ZERO2} --megatron-fsdp-grad-comm-dtype fp16", 2, "--megatron-fsdp-grad-comm-dtype fp16"),
        (f"{ZERO2} --bf16 --megatron-fsdp-main-params-dtype bf16", 2, "--megatron-fsdp-main-params-dtype bf16"),
        # Megatron-LM reads --torch-fsdp2-no-reshard-after-forward for torch FSDP2 only
        (NO_RESHARD, 2, "--torch-fsdp2-no-reshard-after-forward configures PyTorch FSDP2's units (Megatron-LM reads"),
        (f"{FSDP} {NO_RESHARD}", 2, "add --use-torch-fsdp2, or drop it"),
        (f"{ZERO2} {NO_RESHARD}", 2, "add --use-torch-fsdp2, or drop it"),
        (f"{TORCH} --data-parallel-sharding-strategy optim {NO_RESHARD}", 2, "after-forward need --data-parallel"),
    ],
)
def test_combinations_not_built_fail_in_one_line(extra, world_size, message):
    with pytest.raises(ConfigError) as error:
        parse(extra, world_size)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("main_params", ["fp32", "auto"])
def test_precision_aware_states_are_built(main_params):
    """bf16 weight shards beside the optimizer's fp16 main weights and FP8 / fp16 moments (test_fsdp.py)."""
    states = "--use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16"
    fp8 = "--fp8-format hybrid --fp8-param-gather"
    cfg = parse(f"{FSDP} --bf16 {states} --megatron-fsdp-main-params-dtype {main_params} {fp8}")
    assert cfg.sharding.fsdp2 and cfg.optimizer.use_precision_aware_optimizer


@pytest.mark.parametrize("gather", ["", "--fp8-param-gather"])
def test_meta_device_init_with_the_local_fp8_engine_is_built(gather):
    """The FP8 state is made on the run's device, the weights shard by shard (tests/distributed/test_fsdp_meta.py)."""
    cfg = parse(f"{FSDP} --bf16 --init-model-with-meta-device --fp8-format hybrid {gather}")
    assert cfg.parallel.init_model_with_meta_device and cfg.precision.fp8


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "rowwise", "mxfp8"])
def test_fp8_param_gather_with_every_recipe_is_built(recipe):
    """Under FSDP with the local layers, every recipe (tests/distributed/test_fsdp.py; rowwise and mxfp8 cast per
    axis: test_fsdp_fp8_axes.py), and with Transformer Engine's the per-tensor and blockwise ones
    (megatron/parallel/fsdp/te_blockwise_gather.py, tests/gpu/test_te_fsdp_blockwise.py; the others:
    test_te_backend.py); without FSDP the local layers keep FP8 weights of one scale per tensor only
    (`Fp8Parameter`)."""
    cfg = parse(f"{FSDP} --bf16 --fp8-format hybrid --fp8-recipe {recipe} --fp8-param-gather")
    assert cfg.precision.fp8_param_gather and cfg.sharding.fsdp2
    if recipe not in ("delayed", "tensorwise"):
        with pytest.raises(ConfigError, match="the local engine keeps FP8 weights with one scale per tensor"):
            parse(f"--bf16 --fp8-format hybrid --fp8-recipe {recipe} --fp8-param-gather")


@pytest.mark.parametrize("layout", ["--tensor-model-parallel-size 2 --sequence-parallel", "--context-parallel-size 2"])
def test_tensor_and_context_parallelism_compose(layout):
    """FSDP shards each tensor-parallel piece over the data-parallel ranks (tests/distributed/test_fsdp_layouts.py)."""
    cfg = parse(f"{FSDP} {layout}", world_size=4)
    assert cfg.sharding.fsdp2 and cfg.data_parallel_size == 2


def test_overlap_flags_are_noted_not_silent():
    cfg = parse(f"{FSDP} --overlap-grad-reduce --overlap-param-gather --megatron-fsdp-grad-comm-dtype bf16")
    assert any("FSDP2 overlaps" in note for note in cfg.notes)


@pytest.mark.parametrize("extra", ["--fp8-stats-interval 10 --fp8-auto-bf16", "--fp8-stats-interval 10"])
def test_fp8_gathers_compose_with_the_fp8_monitor_and_guard(extra):
    """Built: the layers the guard moves to bf16 gather bf16 (tests/distributed/test_fsdp_fp8_gather_dtypes.py on
    the local layers, tests/gpu/test_te_fsdp_guard.py with TE), the monitor counts the shards' casts
    (tests/unit/test_fp8_monitor.py); meta-device initialization (tests/gpu/test_te_fsdp_meta.py with TE)."""
    fp8 = f"{FSDP} --bf16 --fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather {extra}"
    cfg = parse(fp8)
    assert cfg.sharding.fsdp2 and cfg.precision.fp8_param_gather
    assert cfg.precision.fp8_auto_bf16 == ("--fp8-auto-bf16" in extra)
    assert parse(f"{fp8} --init-model-with-meta-device").parallel.init_model_with_meta_device


@pytest.mark.parametrize("level", ["", "--fp8-optimizer-level O1", "--fp8-optimizer-level O2"])
def test_fp8_grad_reduce_is_built(level):
    """FSDP's reduce-scatters in FP8 (tests/distributed/test_fsdp_fp8_reduce.py); O2 adds the precision-aware states
    and bf16 gradient shards (FSDP's own reading of --grad-reduce-in-bf16)."""
    cfg = parse(f"{FSDP} --bf16 {level or '--fp8-grad-reduce'}")
    assert cfg.sharding.fsdp2 and cfg.parallel.fp8_grad_reduce
    o2 = level.endswith("O2")
    assert cfg.optimizer.use_precision_aware_optimizer == o2 and cfg.parallel.grad_reduce_in_bf16 == o2


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_no_reshard_after_forward_parses_as_megatron_lm_spells_it(strategy):
    """Megatron-LM's store_false flag: FSDP2's units kept gathered from forward to backward (tests/distributed/
    test_fsdp_no_reshard.py). Under optim_grads they are kept for the whole step already: a note says so."""
    assert parse(TORCH).parallel.torch_fsdp2_reshard_after_forward
    cfg = parse(f"{TORCH} --data-parallel-sharding-strategy {strategy} {NO_RESHARD}")
    assert cfg.sharding.fsdp2 and not cfg.parallel.torch_fsdp2_reshard_after_forward
    noted = any(NO_RESHARD in note and "changes nothing more" in note for note in cfg.notes)
    assert noted == (strategy == "optim_grads"), cfg.notes
    both = parse(f"{TORCH} {FSDP} --data-parallel-sharding-strategy {strategy} {NO_RESHARD}")  # FSDP2 runs both
    assert both.sharding.fsdp2 and not both.parallel.torch_fsdp2_reshard_after_forward


@pytest.mark.parametrize("strategy", ["optim_grads", "optim", "no_shard"])
def test_meta_device_init_with_whole_weights_is_built(strategy):
    """Strategies whose ranks hold every weight build the model on the meta device and give it its storage and values
    at once (tests/distributed/test_fsdp_meta.py); Transformer Engine's FP8 weights are made as TE builds them."""
    flags = f"{FSDP} --data-parallel-sharding-strategy {strategy} --bf16 --init-model-with-meta-device"
    fp8 = "--fp8-format hybrid --fp8-param-gather" + ("" if strategy == "no_shard" else " --use-distributed-optimizer")
    cfg = parse(f"{flags} {fp8}")
    assert cfg.parallel.init_model_with_meta_device and not cfg.sharding.fsdp2
    cfg.model.transformer_impl = "transformer_engine"  # TE does not import on a CPU: its rule alone
    with pytest.raises(ConfigError) as error:
        check_meta_device_layers(cfg)
    message = str(error.value)
    assert "Transformer Engine makes its FP8 weights as it builds them" in message and "\n" not in message


def test_async_save_is_built():
    """FSDP's shards are staged and written in the background as the distributed optimizer's are
    (tests/distributed/test_fsdp_async_save.py)."""
    cfg = parse(f"{FSDP} --save /tmp/x --async-save")
    assert cfg.sharding.fsdp2 and cfg.checkpoint.async_save


def test_mx_weights_the_ranks_do_not_divide_are_noted():
    """mxfp8 gathers only weights whose rows the FSDP ranks divide in FP8 (megatron/parallel/fsdp/fp8_gather_axes.py): a
    startup note names the others (here the ffn's 2 x 48 rows over 3 ranks divide, the 32 of the attention projection do
    not)."""
    mx = "--bf16 --fp8-format e4m3 --fp8-recipe mxfp8 --fp8-param-gather --ffn-hidden-size 48"
    mx += " --micro-batch-size 1 --global-batch-size 6"
    notes = " ".join(parse(f"{FSDP} {mx}", world_size=3).notes)
    assert "linear_proj (32 rows), linear_fc2 (32 rows) gather in the training dtype" in notes, notes
    assert "linear_fc1" not in notes and "linear_qkv" not in notes, notes
    assert "gather in the training dtype" not in " ".join(parse(f"{FSDP} {mx}", world_size=2).notes)


@pytest.mark.parametrize(
    "extra, engine, main_grads_bf16, grad_comm_bf16",
    [
        ("--grad-reduce-in-bf16", "buffers", True, True),
        ("--use-distributed-optimizer", "buffers", False, False),
        (f"{ZERO2} --megatron-fsdp-main-grads-dtype bf16", "flat_shards", True, True),
        (f"{ZERO2} --grad-reduce-in-bf16 --megatron-fsdp-grad-comm-dtype fp32", "flat_shards", True, False),
        (f"{FSDP} --megatron-fsdp-grad-comm-dtype bf16", "fsdp2", False, True),
        (f"{FSDP} --use-precision-aware-optimizer --main-grads-dtype bf16", "fsdp2", True, True),  # read last
    ],
)
def test_the_sharding_is_resolved_once_at_finalize(extra, engine, main_grads_bf16, grad_comm_bf16):
    cfg = parse(extra)
    sharding = cfg.sharding
    assert (sharding.engine, sharding.main_grads_bf16, sharding.grad_comm_bf16) == (
        engine,
        main_grads_bf16,
        grad_comm_bf16,
    )
    assert sharding.fsdp2 == (engine == "fsdp2") and sharding.flat_shards == (engine == "flat_shards")
    assert cfg.finalize().sharding == sharding
    with pytest.raises(dataclasses.FrozenInstanceError):
        sharding.engine = "buffers"
    with pytest.raises(RuntimeError, match="Config.finalize"):
        _ = Config().sharding
