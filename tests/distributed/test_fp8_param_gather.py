"""--fp8-param-gather with --use-distributed-optimizer on the local engine: each data-parallel rank casts its shard of
the fp32 masters into the FP8 weights and the all-gather moves FP8 bytes. Step by step the FP8 weights (bytes and
scales) and the losses equal those of the unsharded optimizer with FP8 weights in the same layout (DP=2, TP=2 x DP=2
and PP=2 x DP=2; delayed and tensorwise), the gather moves at most 0.55x the bytes of the bf16 path, and save and
resume at DP=2 reproduces the uninterrupted run; another data-parallel size is refused (test_distributed_optimizer.py
covers that path, which FP8 weights share)."""

from pathlib import Path

import pytest
import torch

import megatron.parallel.data_parallel as data_parallel
from megatron.config import ConfigError
from megatron.fp8.params import Fp8Parameter, fp8_raw_data, is_fp8_param
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import BASE, _parse

STEPS = 3
# No gradient clipping: the sharded optimizer sums the gradient norm in another order, and a clip factor one ulp
# off would move the masters by an ulp (with clipping the two agree to rounding, as tests/distributed/
# test_distributed_optimizer.py shows); everything else is the same arithmetic on the same numbers.
FP8_PARAMS = "--fp8-format hybrid --fp8-param-gather --lr 1e-3 --train-iters 6 --clip-grad 0"
DISTOPT = "--use-distributed-optimizer"
# several buckets, parameters cut by shard boundaries, gathers overlapped with the next forward
SHARDED = f"{DISTOPT} --overlap-param-gather --overlap-grad-reduce --ddp-bucket-size 5000"


def _scale_inv(param: torch.Tensor) -> torch.Tensor:
    for name in ("scale_inv", "_scale_inv"):  # ours; TE's per-tensor
        if isinstance(value := getattr(param, name, None), torch.Tensor):
            return value
    rows, cols = param.shape  # TE's blockwise: one scale per 128x128 block, in a grid TE pads (unset values)
    return param._rowwise_scale_inv[: -(-rows // 128), : -(-cols // 128)]


def _fp8_weights(trainer: Trainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Bytes and scales of every FP8 weight (the local engine's or Transformer Engine's)."""
    trainer.grad_buffers.wait_for_params()
    params = [p for p in trainer.model.parameters() if is_fp8_param(p)]
    assert params
    return [(fp8_raw_data(p).clone(), _scale_inv(p).clone()) for p in params]


def _run(flags: str, world_size: int) -> tuple[list[float], list]:
    trainer = Trainer(_parse(flags, world_size))
    batches = iter(trainer.loader(trainer.datasets.train, 0))
    losses, weights = [], [_fp8_weights(trainer)]
    for _ in range(STEPS):
        loss, _, stepped = trainer.train_step(batches, 1e-3)
        assert stepped
        losses.append(loss)
        weights.append(_fp8_weights(trainer))
    return losses, weights


def _same_as_unsharded_body(rank, world_size, layout, recipes=("delayed", "tensorwise")):
    """Also run by tests/gpu/test_te_fp8_param_gather.py with Transformer Engine's layers (`layout` says so)."""
    for recipe in recipes:
        fmt = "--fp8-format e4m3" if recipe == "blockwise" else ""
        flags = f"{BASE} {layout} {FP8_PARAMS} --fp8-recipe {recipe} {fmt}"
        want_losses, want_weights = _run(flags, world_size)
        got_losses, got_weights = _run(f"{flags} {SHARDED}", world_size)
        assert got_losses == want_losses, (recipe, got_losses, want_losses)
        for step, (got, want) in enumerate(zip(got_weights, want_weights)):
            for i, ((data, scale_inv), (data_want, scale_inv_want)) in enumerate(zip(got, want)):
                where = f"{recipe}, after step {step}, FP8 weight {i}"
                assert torch.equal(scale_inv, scale_inv_want), f"{where}: scales {scale_inv} != {scale_inv_want}"
                assert torch.equal(data, data_want), f"{where}: {int((data != data_want).sum())} bytes differ"


def test_dp2_fp8_weights_match_the_unsharded_optimizer_bitwise():
    run_distributed(_same_as_unsharded_body, world_size=2, args=("",))


@pytest.mark.parametrize(
    "layout", ["--tensor-model-parallel-size 2 --sequence-parallel", "--pipeline-model-parallel-size 2"]
)
def test_tp2_dp2_and_pp2_dp2_fp8_weights_match_the_unsharded_optimizer_bitwise(layout):
    run_distributed(_same_as_unsharded_body, world_size=4, args=(layout,))


# A model whose weights are mostly the transformer linears' (a small vocabulary), as in any real model.
WIDE = BASE.replace("--hidden-size 32", "--hidden-size 128").replace("--ffn-hidden-size 64", "--ffn-hidden-size 512")


def _gather_bytes_body(rank, world_size):
    counted: list[int] = []
    inner = data_parallel._all_gather

    def counting(output, shard, **kwargs):
        counted.append(shard.numel() * shard.element_size())
        return inner(output, shard, **kwargs)

    data_parallel._all_gather = counting
    try:
        moved = {}
        for name, extra in (("bf16", ""), ("fp8", "--fp8-param-gather")):
            counted.clear()
            flags = f"{WIDE} --bf16 --fp8-format hybrid --fp8-recipe tensorwise {DISTOPT} {extra} --train-iters 1"
            flags += " --no-fp8-first-layer-bf16"  # every weight in FP8: the bound is for FP8 weights alone
            trainer = Trainer(_parse(flags, world_size))
            counted.clear()  # the optimizer's first cast at construction gathers nothing; count one step
            trainer.train_step(iter(trainer.loader(trainer.datasets.train, 0)), 1e-3)
            moved[name] = sum(counted)
        assert moved["fp8"] <= 0.55 * moved["bf16"], moved
    finally:
        data_parallel._all_gather = inner


def test_fp8_gather_moves_at_most_055x_the_bytes_of_bf16():
    run_distributed(_gather_bytes_body, world_size=2)


RESUME = f"{BASE} {FP8_PARAMS} --fp8-recipe delayed {SHARDED} --log-interval 1 --eval-interval 1000"


def _resume_body(rank, world_size, out_dir):
    full = _run_iters(f"{RESUME} --train-iters 4", world_size)
    first = _run_iters(f"{RESUME} --train-iters 2 --save {out_dir} --save-interval 2", world_size)
    resumed = _run_iters(f"{RESUME} --train-iters 4 --load {out_dir}", world_size)
    assert first == full[:2] and resumed == full[2:], (full, first, resumed)


def _run_iters(flags: str, world_size: int) -> list[float]:
    trainer = Trainer(_parse(flags, world_size))
    batches = iter(trainer.loader(trainer.datasets.train, trainer.state.consumed_samples))
    losses = []
    while trainer.state.iteration < trainer.cfg.training.train_iters:
        loss, _, _ = trainer.train_step(batches, 1e-3)
        losses.append(loss)
        trainer.state.iteration += 1
        trainer.state.consumed_samples += trainer.cfg.training.global_batch_size
        if trainer.cfg.checkpoint.save and trainer.state.iteration % trainer.cfg.checkpoint.save_interval == 0:
            trainer.checkpoints.save()
    return losses


def test_save_and_resume_at_dp2_reproduces_the_uninterrupted_run(tmp_path):
    run_distributed(_resume_body, world_size=2, args=(str(tmp_path / "ckpt"),))


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8", "blockwise"])
def test_local_fp8_weights_refuse_recipes_without_one_scale_per_tensor(recipe):
    with pytest.raises(ConfigError, match=f"--fp8-param-gather with --fp8-recipe {recipe}: the local engine"):
        _parse(f"{BASE} --fp8-format e4m3 --fp8-recipe {recipe} --fp8-param-gather", 1)


def test_fp8_weights_checkpoint_as_high_precision_values(tmp_path):
    flags = f"{BASE} {FP8_PARAMS} --fp8-recipe tensorwise --train-iters 1 --save {tmp_path}"
    trainer = Trainer(_parse(flags, 1))
    trainer.train()  # layer 2: the first stays in bf16 by default
    state = trainer.model.state_dict()
    weight = trainer.model.decoder.layers[1].mlp.linear_fc1.weight
    assert isinstance(weight, Fp8Parameter)
    saved = state["decoder.layers.1.mlp.linear_fc1.weight"]
    assert saved.dtype == torch.float32 and torch.equal(saved, weight.dequantize())
    # a model without FP8 weights loads them; loading them back into FP8 weights gives the same bytes
    plain = Trainer(_parse(f"{BASE} --train-iters 1 --load {tmp_path} --no-load-optim", 1))
    assert torch.equal(plain.model.decoder.layers[1].mlp.linear_fc1.weight.detach(), saved)
    again = Trainer(_parse(f"{BASE} {FP8_PARAMS} --fp8-recipe tensorwise --load {tmp_path} --no-load-optim", 1))
    assert torch.equal(again.model.decoder.layers[1].mlp.linear_fc1.weight.data, weight.data)
    assert Path(tmp_path, "latest_checkpointed_iteration.txt").exists()
