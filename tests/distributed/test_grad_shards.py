"""--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads: sharded gradient accumulation on the distributed
optimizer's flat buckets (megatron/parallel/fsdp/flat_shards.py), at DP=2 against the distributed optimizer at DP=2 over
10 steps of four micro-batches (small buckets, so that parameters are cut by bucket and shard boundaries): fp32
within 1e-5 relative; bf16, FP8 delayed (local layers) with and without --fp8-param-gather, with every layer
recomputed, bf16 with selective recomputation, and O2's states (precision-aware optimizer, FP8 gradient reduction)
within 1e-3; bf16 gradient shards (--grad-reduce-in-bf16) and bf16 reduce-scatters no further from fp32 gradients
than the distributed optimizer's bf16 buffers are (over 20 steps). TP=2 + SP and CP=2 (4 ranks) within 1e-5 over 6
steps. Measured, not assumed: between steps no bucket holds storage and the gradient state is half the buckets'
elements; between micro-batches only the buckets whose reduce-scatter is still in flight (at most LAG); during a
backward at most a few buckets at once, in a paused pass (calibration) one or two. A checkpoint saved under the
engine resumes it exactly, and the distributed optimizer (DP=2; torch and torch_dist formats) and one process
(torch_dist) with the same first loss, bit for bit, and the next within 1e-5.

New buckets are not zeroed (the fused wgrad GEMMs write `main_grad`, the hook copies the other gradients): every run
here fills them with NaN first, so a region reduced without being written or zeroed would reach the losses. On a
small model of its own the engine is measured to zero only the buckets' padding and the slice of a parameter that got
no gradient, its shards to hold the data-parallel average of the micro-batches' gradients, and a second gradient of
one parameter in a micro-batch (two reentrant recomputed regions) to be refused."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from megatron.model.layers import Linear
from megatron.parallel.fsdp.flat_shards import LAG, FlatGradShards
from megatron.training import Trainer
from megatron.training.data_loading import to_device
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import _close as _close_steps
from tests.distributed.test_fsdp import _run
from tests.distributed.test_parallel_layouts import BASE, FP8, _parse

STEPS = 10  # each micro-batch reduces into the shards, and each step's update shows in the next loss
ROUNDING_STEPS = 20  # bf16 rounding as it accumulates, against fp32 gradients: 10 steps are too few for the bound
FLAGS = f"{BASE} --train-iters {STEPS} --eval-iters 0 --global-batch-size 16 --ddp-bucket-size 3000"
DISTOPT = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
ZERO2 = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-param-gather"
O2 = "--fp8-optimizer-level O2"
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def _close(got: list[float], want: list[float], rel: float, label: str, steps: int = STEPS) -> None:
    _close_steps(got, want, rel, label, steps=steps)


def _bucket_elements(engine: FlatGradShards) -> int:
    return sum(b.numel for b in engine.buckets)


def _held_between_steps(trainer: Trainer) -> None:
    engine = trainer.grad_buffers
    assert isinstance(engine, FlatGradShards)
    assert not any(b.live for b in engine.buckets)
    assert all(p.main_grad.untyped_storage().nbytes() == 0 for p in engine.params)
    itemsize = engine.shards.element_size()
    assert engine.held_grad_bytes() == _bucket_elements(engine) // engine.dp * itemsize


def _parity_body(rank, world_size):
    FlatGradShards.fill_new_buckets = float("nan")
    cases = [
        ("fp32", "", 1e-5),
        ("bf16", "--bf16", 1e-3),
        ("FP8 delayed", f"--bf16 {FP8}", 1e-3),
        # recomputed layers run their backward in a nested (reentrant) backward: their buckets are allocated there
        ("FP8 delayed, every layer recomputed", f"--bf16 {FP8} {RECOMPUTE}", 1e-3),
        ("bf16, selective recomputation", "--bf16 --recompute-activations", 1e-3),
        ("FP8 delayed, --fp8-param-gather", f"--bf16 {FP8} --fp8-param-gather", 1e-3),
        ("O2", f"--bf16 {FP8} {O2}", 1e-3),
    ]
    wants = {}
    for label, flags, rel in cases:
        wants[flags], _ = _run(f"{FLAGS} {flags} {DISTOPT}", world_size)
        got, trainer = _run(f"{FLAGS} {flags} {ZERO2}", world_size)
        _close(got, wants[flags], rel, label)
        _held_between_steps(trainer)
        if O2 in flags:
            assert trainer.optimizer.grads()[0].dtype == torch.bfloat16, label
    # bf16 gradients round differently when each micro-batch is averaged and added into bf16 shards than when the
    # micro-batches are added up in a bf16 bucket and averaged once: both are measured against fp32 gradients (the
    # distributed optimizer's, ~3e-3 apart), and the engine's may not stray further than the distributed optimizer's.
    # Rounding errors compared as they accumulate: over ROUNDING_STEPS.
    flags = FLAGS.replace(f"--train-iters {STEPS}", f"--train-iters {ROUNDING_STEPS}")
    fp32, _ = _run(f"{flags} --bf16 {DISTOPT}", world_size)
    distopt, _ = _run(f"{flags} --bf16 --grad-reduce-in-bf16 {DISTOPT}", world_size)
    got, trainer = _run(f"{flags} --bf16 --grad-reduce-in-bf16 {ZERO2}", world_size)
    assert trainer.optimizer.grads()[0].dtype == torch.bfloat16
    _held_between_steps(trainer)
    comm, _ = _run(f"{flags} --bf16 --megatron-fsdp-grad-comm-dtype bf16 {ZERO2}", world_size)  # fp32 shards
    bound = 1.25 * _largest_error(distopt, fp32)
    assert _largest_error(got, fp32) <= bound and _largest_error(comm, fp32) <= bound, (got, comm, distopt, fp32)


def _largest_error(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) == ROUNDING_STEPS
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def test_grad_shards_match_the_distributed_optimizer():
    run_distributed(_parity_body, world_size=2)


def _memory_body(rank, world_size):
    FlatGradShards.fill_new_buckets = float("nan")
    trainer = Trainer(_parse(f"{FLAGS} --train-iters 1 {ZERO2}", world_size))
    engine = trainer.grad_buffers
    assert len(engine.buckets) >= 6, len(engine.buckets)
    most, allocate = [0], engine._allocate

    def counting(bucket):  # the buckets holding storage at once, whenever one is allocated
        fresh = not bucket.live
        allocate(bucket)
        most[0] = max(most[0], sum(b.live for b in engine.buckets))
        if fresh:  # no parameter's slice zeroed: each still holds the fill, only the padding is zero
            assert all(p.main_grad.isnan().all() for p in bucket.params)
            assert not bucket.data[sum(p.numel() for p in bucket.params) :].any()

    engine._allocate = counting
    batches = iter(trainer.loader(trainer.datasets.train, 0))
    # the host registers an allocating hook per transformer layer each micro-batch, not one per module in it
    layers = list(trainer.model.decoder.layers)
    inside = {id(m) for layer in layers for m in layer.modules()}
    others = [m for m in trainer.model.modules() if id(m) not in inside and next(m.parameters(False), None) is not None]
    allocating, register = [], torch.Tensor.register_hook

    def recording(tensor, hook):
        if getattr(hook, "func", None) == engine._allocate_all:  # a layer's or module's allocating hook
            allocating.append(hook)
        return register(tensor, hook)

    for micro_batch in range(3):  # of one step
        torch.Tensor.register_hook = recording if micro_batch == 0 else register
        try:
            loss = trainer.steps.loss(to_device(next(batches), trainer.device))
        finally:
            torch.Tensor.register_hook = register
        if micro_batch == 0:
            assert len(allocating) == len(layers) + len(others) and len(layers) > 1, (len(allocating), len(others))
        loss.backward()
        alive = [b for b in engine.buckets if b.live]
        assert len(alive) <= LAG and all(b.work is not None for b in alive), len(alive)
        whole = _bucket_elements(engine) * engine.shards.element_size()
        assert engine.held_grad_bytes() <= whole // 2 + LAG * max(b.numel for b in engine.buckets) * 4
        # every parameter got its one gradient of the micro-batch (none zeroed before its reduce-scatter)
        assert all(b.written == len(b.params) for b in engine.buckets)
    engine.finish()
    _held_between_steps(trainer)
    assert 1 < most[0] <= LAG + 2, most[0]  # a few at once, never all of them
    # The gradient the three micro-batches accumulated is the data-parallel average of their sum: the shards hold
    # this rank's part of it
    assert trainer.optimizer.grads() and all(torch.isfinite(g).all() for g in trainer.optimizer.grads())
    assert any(g.abs().sum() > 0 for g in trainer.optimizer.grads())
    # a paused pass (delayed scaling's calibration): buckets come and go alike, nothing is reduced
    most[0] = 0
    with engine.paused():
        trainer.steps.loss(to_device(next(batches), trainer.device)).backward()
        assert not any(b.live for b in engine.buckets)
    assert 1 <= most[0] <= 2, most[0]
    assert all(p.grad is None for p in engine.params)
    # the shards are not zeroed between steps: each bucket's next reduce-scatter overwrites its shard, and one that
    # no micro-batch reached is zeroed when the step finishes (here none did), never left with the last step's sums
    assert engine.shards.any() and all(b.shard_stale for b in engine.buckets)
    engine.finish()
    assert not engine.shards.any()
    _held_between_steps(trainer)


def test_no_whole_gradient_buffer_between_micro_batches_or_steps():
    run_distributed(_memory_body, world_size=2)


def _layouts_body(rank, world_size):
    """Tensor (+ sequence: its norm weights' gradients summed over the tensor-parallel peers' shard pieces) and
    context parallelism beside DP=2."""
    FlatGradShards.fill_new_buckets = float("nan")
    for label, layout in (
        ("TP=2 + SP", "--tensor-model-parallel-size 2 --sequence-parallel"),
        ("CP=2", "--context-parallel-size 2"),
    ):
        flags = f"{BASE} --train-iters 6 --eval-iters 0 --global-batch-size 16 --ddp-bucket-size 3000 {layout}"
        want, _ = _run(f"{flags} {DISTOPT}", world_size)
        got, trainer = _run(f"{flags} {ZERO2}", world_size)
        _close(got, want, 1e-5, label, steps=6)
        _held_between_steps(trainer)


def test_tensor_sequence_and_context_parallel_layouts_match_the_distributed_optimizer():
    run_distributed(_layouts_body, world_size=4)


CKPT = f"{BASE} --eval-iters 0 --global-batch-size 16 --ddp-bucket-size 3000 --train-iters 4"


def _checkpoint_body(rank, world_size, out_dir):
    for fmt in ("torch", "torch_dist"):
        flags, saved = f"{CKPT} --ckpt-format {fmt}", f"{out_dir}/{fmt}"
        whole, _ = _run(f"{flags} {ZERO2}", world_size)
        _run(f"{flags} {ZERO2} --exit-interval 2 --save {saved}", world_size)
        resumed, _ = _run(f"{flags} {ZERO2} --load {saved}", world_size)
        assert resumed == whole[2:], (fmt, resumed, whole)
        resumed, _ = _run(f"{flags} {DISTOPT} --load {saved}", world_size)
        # the first step after the load is the same forward on the same weights: the same loss, bit for bit; the
        # next one's gradients were accumulated in another order
        assert resumed[0] == whole[2], (fmt, resumed, whole)
        _close(resumed, whole[2:], 1e-5, f"the distributed optimizer from the engine's {fmt} checkpoint", steps=2)
    if rank == 0:
        torch.save(whole, f"{out_dir}/whole.pt")


def _one_process_body(rank, world_size, out_dir):
    whole = torch.load(f"{out_dir}/whole.pt")
    resumed, _ = _run(f"{CKPT} --ckpt-format torch_dist --load {out_dir}/torch_dist", world_size)
    assert resumed[0] == whole[2], (resumed, whole)
    _close(resumed, whole[2:], 1e-5, "one process from the engine's torch_dist checkpoint", steps=2)


def test_checkpoint_resumes_the_engine_the_distributed_optimizer_and_one_process(tmp_path):
    run_distributed(_checkpoint_body, world_size=2, args=(str(tmp_path),))
    run_distributed(_one_process_body, world_size=1, args=(str(tmp_path),))


class _Toy(nn.Module):
    """Fused weights (the local Linear's), a bias, a norm-like weight used twice and a tied embedding (gradients
    through `.grad`, summed by autograd), and a parameter that gets no gradient."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(11, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.linear = Linear(8, 8, bias=True, init_std=0.3)
        self.fc = Linear(8, 8, bias=False, init_std=0.3)
        self.unused = nn.Parameter(torch.zeros(3))

    def forward(self, tokens: torch.Tensor, fc_recomputed_twice: bool = False) -> torch.Tensor:
        x = self.linear(self.embedding(tokens) * self.scale) * self.scale
        if fc_recomputed_twice:  # two reentrant regions: fc's weight gets a gradient in each nested backward
            x = checkpoint(self.fc, checkpoint(self.fc, x, use_reentrant=True), use_reentrant=True)
        else:
            x = self.fc(torch.tanh(x))
        return F.linear(x, self.embedding.weight).logsumexp(-1).mean()


class _ZeroedElements(TorchDispatchMode):
    """Counts the elements that zeroing ops write into tensors whose storage has one of `sizes` bytes (the buckets'
    storage: the toy model has no other tensor of those sizes)."""

    def __init__(self, sizes: set[int]):
        super().__init__()
        self.sizes, self.count = sizes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aten = torch.ops.aten
        op = func.overloadpacket
        zeroing = op in (aten.zero_, aten.zeros, aten.zeros_like, aten.new_zeros) or (
            op in (aten.fill_, aten.full) and args[1] == 0
        )
        if zeroing and isinstance(out, torch.Tensor) and out.untyped_storage().nbytes() in self.sizes:
            self.count += out.numel()
        return out


def _toy_body(rank, world_size):
    FlatGradShards.fill_new_buckets = float("nan")
    torch.manual_seed(0)
    model = _Toy()
    reference = copy.deepcopy(model)  # plain autograd: F.linear, no main_grad
    engine = FlatGradShards(model, dist.group.WORLD, bucket_size=60)
    sizes = {b.numel * b.dtype.itemsize for b in engine.buckets}
    assert len(engine.buckets) == 4 and sizes == {1024}  # padded to 256 elements; the toy's tensors are smaller
    padding = sum(b.numel - sum(p.numel() for p in b.params) for b in engine.buckets)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        tokens = torch.randint(0, 11, (3, 5), generator=generator)
        with _ZeroedElements(sizes) as zeroed:
            model(tokens).backward()
        # padding, and the slice of the parameter that got no gradient: no fused weight's slice, nothing else
        assert zeroed.count == padding + model.unused.numel(), (zeroed.count, padding)
        reference(tokens).backward()
    engine.finish()
    for param, want in zip(engine.params, reference.parameters()):
        grad = torch.zeros_like(want) if want.grad is None else want.grad
        dist.all_reduce(grad)
        if (owned := engine.owned_range(param)) is not None:
            got = engine.grad_piece(param, *owned)
            torch.testing.assert_close(got, grad.view(-1)[owned[0] : owned[1]] / world_size, rtol=1e-6, atol=1e-7)
    engine.zero()
    with pytest.raises(RuntimeError, match="two gradients in one micro-batch"):
        model(torch.randint(0, 11, (3, 5), generator=generator), fc_recomputed_twice=True).backward()
    engine.remove_hooks()
    assert not model.fc.weight.overwrite_main_grad  # gradient buffers built later accumulate again


def test_buckets_are_written_not_zeroed_and_reduce_the_average():
    run_distributed(_toy_body, world_size=2)
