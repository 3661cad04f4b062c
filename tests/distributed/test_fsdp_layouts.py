"""FSDP (PyTorch's FSDP2) composed with tensor parallelism (+ sequence parallelism) and with context parallelism, on
four gloo processes, against the distributed optimizer on the same layout (two micro-batches a step) over 10 steps
(what TP and CP add, FSDP's sharding of tensor-parallel pieces or over data x context parallel ranks and their
gradient reduction, shows from the second step; 4 processes on 2 cores make each step costly).

TP=2 x FSDP=2: each rank's tensor-parallel piece of every weight is sharded over its two data-parallel ranks. fp32
within 1e-5 relative with gradient clipping active (the norm over the two-dimensional shards counts every element once),
bf16 (untied embeddings, multi-layer units, prefetch) and the local FP8 linears with --fp8-param-gather (delayed with
full recomputation, tensorwise with optim_grads) within 1e-3, both strategies; between steps a rank holds at most half
of its tensor-parallel piece's weight, gradient and Adam bytes plus one unit. With --fp8-param-gather each gathered
weight's scale is the whole tensor's (agreed over data x tensor parallel ranks, as the tensorwise recipe and the
distributed optimizer cast a tensor-parallel weight). A torch_dist checkpoint saved there (from --init-model-with-meta-
device, whose parameters keep their tensor-parallel attributes) resumes exactly, and within 1e-5 under TP=2 x DP=2 with
the distributed optimizer and in one process.

CP=2 x FSDP=2: FSDP shards over the four data x context parallel ranks; fp32 within 1e-5, tensorwise with
--fp8-param-gather (optim_grads) within 1e-3, and its checkpoint resumes there exactly and under the distributed
optimizer within 1e-5."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import (
    CKPT,
    DISTOPT,
    GRADS,
    PARAMS,
    UNITS,
    _close,
    _gathered_bytes,
    _held_bytes,
    _run,
    resume_across,
)
from tests.distributed.test_parallel_layouts import BASE, FP8, TENSORWISE, _parse

TP = "--tensor-model-parallel-size 2"
SP = f"{TP} --sequence-parallel"
CP = "--context-parallel-size 2"
STEPS = 10
FLAGS = f"{BASE} --train-iters {STEPS} --eval-iters 0"
CP_FLAGS = f"{FLAGS} {CP}"
RECOMPUTE = " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
# (layout and precision, the FSDP strategy and its extra flags), within 1e-3 of the distributed optimizer's
TP_CASES = [
    # untied embeddings, units of three layers (about 4.8k elements a layer here), the next unit prefetched
    (f"{TP} --bf16 --untie-embeddings-and-output-weights", f"{PARAMS} {UNITS}"),
    # FP8 weights gathered as FP8 (a bf16 gather is what FSDP does without --fp8-param-gather; tests/distributed/
    # test_fsdp.py covers it at DP=2): two cases, each with two features, so the suite stays within its time
    (f"{SP} --bf16 {FP8} --fp8-param-gather", PARAMS + RECOMPUTE),
    (f"{SP} --bf16 {TENSORWISE} --fp8-param-gather", GRADS),
]


def _assert_whole_tensor_scales(trainer: Trainer) -> None:
    """Each FP8-gathered weight's agreed amax is the largest magnitude of the whole weight: of its unsharded
    tensor-parallel piece (FSDP's full_tensor) and of the other piece (tensor-parallel group); both pieces' scales
    are equal."""
    scales = trainer.grad_buffers.fp8_scales
    scales.stale = True
    scales.agree()
    assert scales.shards
    for shard in scales.shards:
        assert isinstance(shard, DTensor)
        with torch.no_grad():
            whole = shard.full_tensor().abs().amax().float()
        dist.all_reduce(whole, op=dist.ReduceOp.MAX, group=trainer.dims.tp_group)
        gathered = shard.to_local()._scale
        assert torch.equal(gathered.amax, whole), (gathered.amax, whole)
        pieces = [torch.zeros_like(gathered.scale) for _ in range(2)]
        dist.all_gather(pieces, gathered.scale, group=trainer.dims.tp_group)
        assert torch.equal(pieces[0], pieces[1]), pieces


def _tp_body(rank, world_size, out_dir):
    flags = f"{FLAGS} {SP} --clip-grad 0.1"  # grad norm about 0.7: every step clipped
    want, distopt = _run(f"{flags} {DISTOPT}", world_size)
    got, trainer = _run(f"{flags} {PARAMS}", world_size)
    _close(got, want, 1e-5, "TP=2 x FSDP=2, fp32", steps=STEPS)
    # fp32 weights, gradients and two moments per element of this rank's tensor-parallel piece, halved, plus a layer's
    numel = sum(p.numel() for p in distopt.model.parameters())
    layer = sum(p.numel() for p in trainer.model.decoder.layers[0].parameters())
    held, bound = _held_bytes(trainer), 16 * (numel / 2 + layer)
    assert _gathered_bytes(trainer.model) == 0
    assert held <= bound < _held_bytes(distopt), (held, bound, _held_bytes(distopt))
    for flags, strategy in TP_CASES:
        want, _ = _run(f"{FLAGS} {flags} {DISTOPT}", world_size)
        got, trainer = _run(f"{FLAGS} {flags} {strategy}", world_size)
        _close(got, want, 1e-3, f"{flags} {strategy}", steps=STEPS)
        if "fp8-param-gather" in flags:
            _assert_whole_tensor_scales(trainer)
    # Built on the meta device: the checkpoint places its TP pieces by the attributes kept through to_empty
    whole = resume_across(SP, f"{out_dir}/tp", world_size, "--init-model-with-meta-device")
    if rank == 0:
        torch.save(whole, f"{out_dir}/whole.pt")


def test_fsdp_with_tensor_parallelism_matches_distributed_optimizer(tmp_path):
    run_distributed(_tp_body, world_size=4, args=(str(tmp_path),))
    whole = torch.load(tmp_path / "whole.pt")
    resumed = list(Trainer(_parse(f"{CKPT} --train-iters 4 --load {tmp_path}/tp", 1)).train().losses.values())
    _close(resumed, whole[2:], 1e-5, "one process from TP=2 x FSDP=2's checkpoint", steps=2)


def _cp_body(rank, world_size, out_dir):
    want, _ = _run(f"{CP_FLAGS} {DISTOPT}", world_size)
    got, trainer = _run(f"{CP_FLAGS} {PARAMS}", world_size)
    _close(got, want, 1e-5, "CP=2 x FSDP=2", steps=STEPS)
    assert dist.get_world_size(trainer.dims.dp_cp_group) == 4
    flags = f"{CP_FLAGS} --bf16 {TENSORWISE} --fp8-param-gather"
    want, _ = _run(f"{flags} {DISTOPT}", world_size)
    got, _ = _run(f"{flags} {GRADS}", world_size)
    _close(got, want, 1e-3, "CP=2 x FSDP=2, FP8 all-gather", steps=STEPS)
    resume_across(CP, f"{out_dir}/cp", world_size)


def test_fsdp_with_context_parallelism_matches_distributed_optimizer(tmp_path):
    run_distributed(_cp_body, world_size=4, args=(str(tmp_path),))
