"""FSDP (--use-megatron-fsdp, PyTorch's FSDP2) at DP=2 against the distributed optimizer at DP=2 over 10 steps (two
micro-batches per step: gradients accumulate into the shards): fp32 losses within 1e-5 relative, bf16 and FP8
(delayed, tensorwise; bf16 all-gather; delayed with every layer recomputed) within 1e-3;
both strategies (optim_grads_params, optim_grads), and untied embeddings with units of two layers and explicit
prefetch. With --fp8-param-gather (tensorwise; delayed) FSDP all-gathers E4M3 bytes: within 1e-3 of the distributed
optimizer's FP8 weights, each layer's gather at most 0.55x bf16's bytes, one amax all-reduce per step. Between
steps each rank holds at most half of the weight, gradient and Adam state bytes plus one unit, measured from the
tensors it holds (and no gathered weights), where the distributed optimizer holds whole weights and gradients. A
torch_dist checkpoint of FSDP (each rank writes its own shards) resumes FSDP exactly, and the distributed optimizer
and one process within 1e-5. With --use-precision-aware-optimizer (fp16 main weights, FP8 / fp16 moments) the weight
shards are bf16: bf16, delayed (optim_grads) and delayed with --fp8-param-gather within 1e-3 of the distributed
optimizer with the same flags, each rank holding at most half the bytes the states' dtypes imply plus one layer, and
a checkpoint resumed exactly (within 1e-3 under the distributed optimizer). --init-model-with-meta-device gives
the eager weights bit for bit (fp32; bf16 with untied embeddings), building one part of the model at a time.
Blockwise with --fp8-param-gather (blocks cut by the shard boundary) matches FSDP's bf16 gather within 1e-3 over 4
steps in at most 0.55x the bytes per layer, its gathered bytes and block scales the whole weight's cast exactly."""

import torch
import torch.distributed as dist

from megatron.fp8.formats import E4M3
from megatron.fp8.quantize import BLOCK_128x128, quantize
from megatron.model import meta_init
from megatron.optim.states import state_bytes
from megatron.parallel.fsdp import fsdp2_internals as internals
from megatron.parallel.fsdp.fp8_gather import gathered_bytes, shard_data
from megatron.parallel.fsdp.fsdp2 import local_shard
from megatron.training import Trainer
from megatron.training.data_loading import to_device
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import BASE, FP8, TENSORWISE, _parse

STEPS = 10
FLAGS = f"{BASE} --train-iters {STEPS} --eval-iters 0"
DISTOPT = "--use-distributed-optimizer"
PARAMS = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
GRADS = "--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads"
# About 9.3k elements per layer: units of two layers
UNITS = "--untie-embeddings-and-output-weights --fsdp-double-buffer --suggested-communication-unit-size 10000"


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (padding of a shard included)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def _gathered_bytes(model) -> int:
    """Bytes of all-gathered (unsharded) weights FSDP2 still holds."""
    outputs = [
        t for unit in internals.units(model) for p in internals.unit_params(unit) for t in internals.gathered_outputs(p)
    ]
    return sum(t.untyped_storage().nbytes() for t in outputs)


def _fp8_gathered(trainer) -> list[torch.Tensor]:
    """--fp8-param-gather: the FP8-gathered weights' sharded parameters (none without)."""
    scales = getattr(trainer.optimizer.buffers, "fp8_scales", None)
    return scales.shards if scales is not None else []


def _held_bytes(trainer) -> int:
    """Weights, gradients, main copies and Adam moments this rank holds between steps (the precision-aware
    optimizer's: its encoded tensors, their remainders and block scales); with --fp8-param-gather also the FP8
    weights' shards cast to E4M3, kept from one step's cast to the next (parallel/fsdp/fp8_gather_scales.py)."""
    opt = trainer.optimizer
    weights = _storage_bytes(shard_data(local_shard(p)) for p in trainer.model.parameters())
    weights += _storage_bytes(p.to_local()._scale.data for p in _fp8_gathered(trainer))
    grads = _storage_bytes(shard_data(p.main_grad) for p in opt.params)
    if opt.precision_aware:
        encoded = [s for states in opt.encoded_states().values() for s in states]
        return weights + grads + _storage_bytes(t for s in encoded for t in (s.data, s.remainder, s.scales))
    mains = _storage_bytes(opt.main_params) if opt.mixed else 0
    states = _storage_bytes(t for s in opt.optimizer.state.values() for t in s.values() if t.dim() > 0)
    return weights + grads + mains + states


def _run(flags: str, world_size: int) -> tuple[list[float], Trainer]:
    trainer = Trainer(_parse(flags, world_size))
    return list(trainer.train().losses.values()), trainer


def _close(got: list[float], want: list[float], rel: float, label: str, steps: int = STEPS) -> None:
    assert len(got) == len(want) == steps, label
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= rel * abs(b), f"{label} step {step}: {a} vs {b}"


def _body(rank, world_size):
    for precision, rel in (("", 1e-5), ("--bf16", 1e-3)):
        want, distopt = _run(f"{FLAGS} {precision} {DISTOPT}", world_size)
        numel = sum(p.numel() for p in distopt.model.parameters())
        for name, flags in (("optim_grads_params", PARAMS), ("optim_grads", GRADS)):
            got, trainer = _run(f"{FLAGS} {precision} {flags}", world_size)
            _close(got, want, rel, f"{name} {precision}")
            # fp32 weights, fp32 gradients and two fp32 moments per element, halved, plus one layer's worth
            layer = sum(p.numel() for p in trainer.model.decoder.layers[0].parameters())
            held, bound = _held_bytes(trainer), 16 * (numel / 2 + layer)
            assert _gathered_bytes(trainer.model) == 0, name
            assert held <= bound < _held_bytes(distopt), (name, precision, held, bound, _held_bytes(distopt))
    # bf16 gradient shards (and bf16 reduce-scatters) against the distributed optimizer's bf16 gradient buffers
    want, _ = _run(f"{FLAGS} --bf16 --grad-reduce-in-bf16 {DISTOPT}", world_size)
    got, trainer = _run(f"{FLAGS} --bf16 --megatron-fsdp-main-grads-dtype bf16 {PARAMS}", world_size)
    assert trainer.optimizer.grads()[0].dtype == torch.bfloat16
    _close(got, want, 1e-3, "bf16 gradient shards")
    want, _ = _run(f"{FLAGS} --untie-embeddings-and-output-weights {DISTOPT}", world_size)
    got, trainer = _run(f"{FLAGS} {UNITS} {PARAMS}", world_size)
    _close(got, want, 1e-5, "two-layer units, untied")
    units = list(internals.units(trainer.model))
    assert len(units) == 5, len(units)  # root, embedding, two units of two layers, final norm + output layer


def test_fsdp_matches_distributed_optimizer_and_holds_a_shard():
    run_distributed(_body, world_size=2)


def _fp8_body(rank, world_size):
    recompute = " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    for recipe, layouts in ((FP8, (PARAMS, GRADS)), (TENSORWISE, (PARAMS,)), (FP8 + recompute, (PARAMS,))):
        want, _ = _run(f"{FLAGS} --bf16 {recipe} {DISTOPT}", world_size)
        for layout in layouts:  # the local FP8 linears cast the gathered bf16 weights
            got, trainer = _run(f"{FLAGS} --bf16 {recipe} {layout}", world_size)
            assert trainer.fp8 is not None
            # A micro-batch's forward and backward leave no FP8 copy of the (freed) gathered weights behind; under
            # optim_grads (weights gathered for the whole step) the cast is kept for the step's later micro-batches,
            # as under the distributed optimizer (the FP8 manager drops it after each step)
            batch = to_device(next(iter(trainer.loader(trainer.datasets.train, 0))), trainer.device)
            trainer.steps.loss(batch).backward()
            states = [m.fp8 for m in trainer.model.modules() if getattr(m, "fp8", None) is not None]
            assert states and all((s._weight_cache is not None) == (layout == GRADS) for s in states), layout
            _close(got, want, 1e-3, f"{recipe} {layout}")


def test_fsdp_fp8_matches_distributed_optimizer():
    run_distributed(_fp8_body, world_size=2)


CKPT = f"{BASE} --eval-iters 0 --ckpt-format torch_dist"


def resume_across(layout: str, saved: str, world_size: int, save_flags: str = "", rel: float = 1e-5) -> list[float]:
    """Save FSDP's torch_dist checkpoint under `layout` (more flags of the saving run: `save_flags`) at step 2 of 4;
    resume it there (exactly) and under the distributed optimizer on the same layout (within `rel`). Returns the
    uninterrupted run's losses."""
    flags = f"{CKPT} {layout} --train-iters 4"
    whole, _ = _run(f"{flags} {PARAMS}", world_size)
    _run(f"{flags} --exit-interval 2 {PARAMS} {save_flags} --save {saved}", world_size)
    resumed, _ = _run(f"{flags} {PARAMS} --load {saved}", world_size)
    assert resumed == whole[2:], (layout, resumed, whole)
    resumed, _ = _run(f"{flags} {DISTOPT} --load {saved}", world_size)
    _close(resumed, whole[2:], rel, f"the distributed optimizer ({layout}) from FSDP's checkpoint", steps=2)
    return whole


def _checkpoint_body(rank, world_size, out_dir):
    whole = resume_across("", f"{out_dir}/fsdp", world_size)
    if rank == 0:
        torch.save(whole, f"{out_dir}/whole.pt")
    _precision_aware_body(world_size, out_dir)


PA = "--use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16"


def precision_aware_held(trainer) -> tuple[int, float]:
    """The bytes a rank holds between steps under FSDP with `PA`'s states, and what their dtypes imply over two ranks
    plus one layer: bf16 weights, fp32 gradients, fp16 main weights (+ int8 remainder), fp8 and fp16 moments (+ block
    scales); with --fp8-param-gather 1 byte more per FP8-gathered element over two ranks, its shard's E4M3 cast kept
    for the step's all-gathers."""
    per_param = 2 + 4 + state_bytes("fp16", master=True) + state_bytes("fp8") + state_bytes("fp16")
    numel = sum(p.numel() for p in trainer.model.parameters())
    layer = sum(p.numel() for p in trainer.model.decoder.layers[0].parameters())
    fp8_casts = sum(p.numel() for p in _fp8_gathered(trainer)) / 2
    return _held_bytes(trainer), per_param * (numel / 2 + layer) + fp8_casts


def _precision_aware_body(world_size, out_dir):
    """--use-precision-aware-optimizer (O2's state dtypes) under FSDP: bf16 weight shards beside the optimizer's fp16
    main weights and FP8 / fp16 moments of the shard, against the distributed optimizer with the same flags."""
    flags = f"{FLAGS} --bf16 {PA}"
    for name, extra, layout in (
        ("bf16", "", PARAMS),
        ("delayed", FP8, GRADS),
        ("delayed, FP8 all-gather", f"{FP8} --fp8-param-gather", PARAMS),
    ):
        want, _ = _run(f"{flags} {extra} {DISTOPT}", world_size)
        got, trainer = _run(f"{flags} {extra} {layout}", world_size)
        _close(got, want, 1e-3, f"precision-aware states, {name}")
        assert {local_shard(p).dtype for p in trainer.model.parameters()} == {torch.bfloat16}, name
        held, bound = precision_aware_held(trainer)
        assert _gathered_bytes(trainer.model) == 0, name
        assert held <= bound, (name, held, bound)
    # Its torch_dist checkpoint resumes exactly, and under the distributed optimizer with the same flags (its
    # states re-encoded in that layout's blocks, stochastic rounding seeded afresh)
    resume_across(f"--bf16 {PA}", f"{out_dir}/precision_aware", world_size, rel=1e-3)


def test_fsdp_checkpoint_saves_shards_and_loads_under_other_layouts(tmp_path):
    run_distributed(_checkpoint_body, world_size=2, args=(str(tmp_path),))
    # Each rank wrote its own half of the weights and states: nothing was gathered on one rank
    files = sorted((tmp_path / "fsdp" / "iter_0000002").glob("*.distcp"))
    sizes = [f.stat().st_size for f in files]
    assert len(sizes) == 2 and min(sizes) > 0.8 * max(sizes), sizes
    whole = torch.load(tmp_path / "whole.pt")
    resumed = list(Trainer(_parse(f"{CKPT} --train-iters 4 --load {tmp_path}/fsdp", 1)).train().losses.values())
    _close(resumed, whole[2:], 1e-5, "one process from FSDP's checkpoint", steps=2)


def _meta_body(rank, world_size):
    parts = []  # the most parameter elements a rank built at once, per initialization
    fill = meta_init.DeferredInit.__call__
    meta_init.DeferredInit.__call__ = lambda self, model: (fill(self, model), parts.append(self.largest_part))[0]
    for extra in ("", "--bf16 --untie-embeddings-and-output-weights"):
        flags = f"{FLAGS} {PARAMS} {extra} --train-iters 2"
        eager = Trainer(_parse(flags, world_size))
        meta = Trainer(_parse(f"{flags} --init-model-with-meta-device", world_size))
        for (name, a), b in zip(eager.model.named_parameters(), meta.model.parameters()):
            assert torch.equal(local_shard(a), local_shard(b)), name
        # One part at a time (here a layer, the largest part), never the whole model
        assert parts.pop() == max(sum(p.numel() for p in layer.parameters()) for layer in eager.model.decoder.layers)
        assert list(meta.train().losses.values()) == list(eager.train().losses.values()), extra


def test_meta_device_init_gives_the_eager_weights():
    run_distributed(_meta_body, world_size=2)


def _counted(flags: str, world_size: int) -> tuple[list[float], list[int], int, Trainer]:
    """Losses of a run, the bytes each rank sent into every all-gather (FSDP2 calls all_gather_single), the
    number of all-reduces it ran, and its trainer."""
    sent, reduces = [], []
    # FSDP2's all-gather: all_gather_single in torch 2.13, all_gather_into_tensor in earlier ones (the GPU image's)
    gathers = {
        name: getattr(dist, name) for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)
    }
    reduce = dist.all_reduce

    def counting(gather):
        def counting_gather(output, input, *args, **kwargs):
            sent.append(input.numel() * input.element_size())
            return gather(output, input, *args, **kwargs)

        return counting_gather

    def counting_reduce(*args, **kwargs):
        reduces.append(1)
        return reduce(*args, **kwargs)

    for name, gather in gathers.items():
        setattr(dist, name, counting(gather))
    dist.all_reduce = counting_reduce
    try:
        losses, trainer = _run(flags, world_size)
    finally:
        for name, gather in gathers.items():
            setattr(dist, name, gather)
        dist.all_reduce = reduce
    return losses, sent, len(reduces), trainer


def _fp8_gather_body(rank, world_size, out_dir):
    flags = f"{FLAGS} --bf16 {TENSORWISE}"
    want, _ = _run(f"{flags} --fp8-param-gather {DISTOPT}", world_size)
    got, fp8_sent, fp8_reduces, _ = _counted(f"{flags} --fp8-param-gather {PARAMS}", world_size)
    _close(got, want, 1e-3, "FSDP FP8 all-gather")
    _, bf16_sent, bf16_reduces, _ = _counted(f"{flags} {PARAMS}", world_size)
    # The same all-gathers in the same order: the root's (embeddings, no FP8 weight) unchanged, each layer's at most
    # 0.55x the bytes (E4M3 linears, bf16 norms): 3 layers gathered for forward and backward, the last for its
    # forward only (it stays gathered for its backward), two micro-batches
    assert len(fp8_sent) == len(bf16_sent), (len(fp8_sent), len(bf16_sent))
    shrunk = [(a, b) for a, b in zip(fp8_sent, bf16_sent) if a != b]
    assert len(shrunk) == (3 * 2 + 1) * 2 * STEPS and all(a <= 0.55 * b for a, b in shrunk), shrunk[:4]
    assert fp8_reduces - bf16_reduces == STEPS  # one amax all-reduce per step for all FP8 weights
    got, _ = _run(f"{flags} --fp8-param-gather {GRADS}", world_size)  # gathered once per step, kept
    _close(got, want, 1e-3, "FSDP FP8 all-gather, optim_grads")
    want, _ = _run(f"{FLAGS} --bf16 {FP8} --fp8-param-gather {DISTOPT}", world_size)  # delayed scaling
    got, _ = _run(f"{FLAGS} --bf16 {FP8} --fp8-param-gather {PARAMS}", world_size)
    _close(got, want, 1e-3, "FSDP FP8 all-gather, delayed")
    # Its torch_dist checkpoint holds the plain fp32 shards and resumes exactly
    flags = f"{CKPT} --bf16 {TENSORWISE} --fp8-param-gather --train-iters 4 {PARAMS}"
    whole, _ = _run(flags, world_size)
    _run(f"{flags} --exit-interval 2 --save {out_dir}/fp8", world_size)
    resumed, _ = _run(f"{flags} --load {out_dir}/fp8", world_size)
    assert resumed == whole[2:], (resumed, whole)


def test_fsdp_fp8_all_gather_matches_distributed_optimizer_in_half_the_bytes(tmp_path):
    run_distributed(_fp8_gather_body, world_size=2, args=(str(tmp_path),))


BLOCKWISE = " --fp8-format hybrid --fp8-recipe blockwise --lr 1e-3 --no-fp8-first-layer-bf16"


def _gather_rows(shard: torch.Tensor, rows: int, world_size: int) -> torch.Tensor:
    """The whole tensor of `rows` rows from each rank's row shard (FSDP's: ceil(rows / ranks) rows, the last short)."""
    padded = torch.zeros((-(-rows // world_size), *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    padded[: shard.shape[0]] = shard
    pieces = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(pieces, padded)
    return torch.cat(pieces)[:rows]


def _fp8_blockwise_body(rank, world_size):
    # ffn 160: fc1 [320, 32] splits at row 160, inside its second 128-row block; every other weight (< 128 rows) has
    # its one block row cut in two: each block's scale is agreed across the shards
    flags = f"{BASE} --train-iters 4 --eval-iters 0 --bf16 {BLOCKWISE} --ffn-hidden-size 160 {PARAMS}"
    want, bf16_sent, bf16_reduces, _ = _counted(flags, world_size)
    got, fp8_sent, fp8_reduces, trainer = _counted(f"{flags} --fp8-param-gather", world_size)
    _close(got, want, 1e-3, "FSDP FP8 all-gather, blockwise", steps=4)
    assert len(fp8_sent) == len(bf16_sent), (len(fp8_sent), len(bf16_sent))
    shrunk = [(a, b) for a, b in zip(fp8_sent, bf16_sent) if a != b]
    assert len(shrunk) == (3 * 2 + 1) * 2 * 4 and all(a <= 0.55 * b for a, b in shrunk), shrunk[:4]  # the last: once
    assert fp8_reduces - bf16_reduces == 4  # one block-amax all-reduce per step for all FP8 weights
    # Each weight's gathered bytes and block scales are the linear's cast of the whole fp32 weight, bit for bit
    scales = trainer.optimizer.buffers.fp8_scales
    scales.stale = True
    scales.agree()
    for param in scales.shards:
        local = param.to_local()
        (data,), (scale_inv, amax) = local.fsdp_pre_all_gather(param.device_mesh, param.shape, None, None, None)
        whole = _gather_rows(local._tensor, param.shape[0], world_size)
        cast, _ = quantize(whole, BLOCK_128x128, E4M3, power_of_two=True)
        assert torch.equal(_gather_rows(gathered_bytes(data), param.shape[0], world_size), cast.data.view(torch.uint8))
        assert torch.equal(scale_inv, cast.scale_inv) and torch.equal(amax, cast.amax)


def test_fsdp_fp8_all_gather_blockwise_matches_the_bf16_gather_in_half_the_bytes():
    run_distributed(_fp8_blockwise_body, world_size=2)
