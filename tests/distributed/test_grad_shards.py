"""--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads: sharded gradient accumulation on the distributed
optimizer's flat buckets (megatron/parallel/grad_shards.py), at DP=2 against the distributed optimizer at DP=2 over
20 steps of four micro-batches (small buckets, so that parameters are cut by bucket and shard boundaries): fp32
within 1e-5 relative; bf16, FP8 delayed (local layers) with and without --fp8-param-gather, with every layer
recomputed, bf16 with selective recomputation, and O2's states (precision-aware optimizer, FP8 gradient reduction)
within 1e-3; bf16 gradient shards (--grad-reduce-in-bf16) and bf16 reduce-scatters no further from fp32 gradients
than the distributed optimizer's bf16 buffers are. TP=2 + SP and CP=2 (4 ranks) within 1e-5 over 6 steps. Measured,
not assumed: between steps no bucket holds storage and the gradient state is half the buckets' elements; between
micro-batches only the buckets whose reduce-scatter is still in flight (at most LAG); during a backward at most a few
buckets at once, in a paused pass (calibration) one or two. A checkpoint saved under the engine resumes it exactly,
and the distributed optimizer (DP=2; torch and torch_dist formats) and one process (torch_dist) with the same first
loss, bit for bit, and the next within 1e-5."""

import torch

from megatron.parallel.grad_shards import LAG, GradShards
from megatron.training import Trainer
from megatron.training.data_loading import to_device
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import _close, _run
from tests.distributed.test_parallel_layouts import BASE, FP8, _parse

STEPS = 20
FLAGS = f"{BASE} --train-iters {STEPS} --eval-iters 0 --global-batch-size 16 --ddp-bucket-size 3000"
DISTOPT = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
ZERO2 = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-param-gather"
O2 = "--fp8-optimizer-level O2"
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def _bucket_elements(engine: GradShards) -> int:
    return sum(b.numel for b in engine.buckets)


def _held_between_steps(trainer: Trainer) -> None:
    engine = trainer.grad_buffers
    assert isinstance(engine, GradShards)
    assert all(b.data is None for b in engine.buckets)
    assert all(p.main_grad.device.type == "meta" for p in engine.params)
    itemsize = engine.shards.element_size()
    assert engine.held_grad_bytes() == _bucket_elements(engine) // engine.dp * itemsize


def _parity_body(rank, world_size):
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
    for label, flags, rel in cases:
        want, _ = _run(f"{FLAGS} {flags} {DISTOPT}", world_size)
        got, trainer = _run(f"{FLAGS} {flags} {ZERO2}", world_size)
        _close(got, want, rel, label)
        _held_between_steps(trainer)
        if O2 in flags:
            assert trainer.optimizer.grads()[0].dtype == torch.bfloat16, label
    # bf16 gradients round differently when each micro-batch is averaged and added into bf16 shards than when the
    # micro-batches are added up in a bf16 bucket and averaged once: both are measured against fp32 gradients (the
    # distributed optimizer's, ~3e-3 apart), and the engine's may not stray further than the distributed optimizer's
    fp32, _ = _run(f"{FLAGS} --bf16 {DISTOPT}", world_size)
    distopt, _ = _run(f"{FLAGS} --bf16 --grad-reduce-in-bf16 {DISTOPT}", world_size)
    got, trainer = _run(f"{FLAGS} --bf16 --grad-reduce-in-bf16 {ZERO2}", world_size)
    assert trainer.optimizer.grads()[0].dtype == torch.bfloat16
    _held_between_steps(trainer)
    comm, _ = _run(f"{FLAGS} --bf16 --megatron-fsdp-grad-comm-dtype bf16 {ZERO2}", world_size)  # fp32 shards
    bound = 1.25 * _largest_error(distopt, fp32)
    assert _largest_error(got, fp32) <= bound and _largest_error(comm, fp32) <= bound, (got, comm, distopt, fp32)


def _largest_error(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) == STEPS
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def test_grad_shards_match_the_distributed_optimizer():
    run_distributed(_parity_body, world_size=2)


def _memory_body(rank, world_size):
    trainer = Trainer(_parse(f"{FLAGS} --train-iters 1 {ZERO2}", world_size))
    engine = trainer.grad_buffers
    assert len(engine.buckets) >= 6, len(engine.buckets)
    most, allocate = [0], engine._allocate

    def counting(bucket):  # the buckets holding storage at once, whenever one is allocated
        allocate(bucket)
        most[0] = max(most[0], sum(b.data is not None for b in engine.buckets))

    engine._allocate = counting
    batches = iter(trainer.loader(trainer.datasets.train, 0))
    for _ in range(3):  # micro-batches of one step
        trainer.steps.loss(to_device(next(batches), trainer.device)).backward()
        alive = [b for b in engine.buckets if b.data is not None]
        assert len(alive) <= LAG and all(b.work is not None for b in alive), len(alive)
        whole = _bucket_elements(engine) * engine.shards.element_size()
        assert engine.held_grad_bytes() <= whole // 2 + LAG * max(b.numel for b in engine.buckets) * 4
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
        assert all(b.data is None for b in engine.buckets)
    assert 1 <= most[0] <= 2, most[0]
    assert not engine.shards.any() and all(p.grad is None for p in engine.params)  # zeroed on exit
    _held_between_steps(trainer)


def test_no_whole_gradient_buffer_between_micro_batches_or_steps():
    run_distributed(_memory_body, world_size=2)


def _layouts_body(rank, world_size):
    """Tensor (+ sequence: its norm weights' gradients summed over the tensor-parallel peers' shard pieces) and
    context parallelism beside DP=2."""
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
