"""Which ops the FSDP O2 step launches, with their bytes (CPU, 2 gloo ranks, local layers for TE).

Issue 30's profile puts every `multi_tensor_apply_kernel` in the bound's "optimizer" category (megatron/perf/report.py
matches kernel names only), whatever launched it. This census runs the benchmark's flags for
`te-delayed-fp8params-nocalib --layouts fsdp2_o2states` on a small model and counts the aten ops of every training
step by phase (a TorchDispatchMode; the phase is the function of the trainer or optimizer it ran in), with their dtypes,
calls, tensors and bytes (each distinct tensor an op reads or writes counted once: a lower bound on what a kernel
moves). Bytes are also given per element of this rank's shard, which times the 8B's 4.0e9 (DP=2) gives its bytes.

The precision-aware step runs eager on the CPU; on CUDA it is one Triton kernel per tensor (adam_kernel.py), so the
census records that kernel's launches and bytes (gradient read, states read and written, the model copy written)
instead of the eager ops. FSDP2's `fsdp.all_gather_copy_in` is one custom op wrapping a `_foreach_copy_` (a
multi_tensor_apply kernel on CUDA) in the all-gather dtype: recorded with that dtype and 2x its inputs' bytes.

    python scripts/optim_step_ops.py [--steps 3] [--layers 4] [--all]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import io
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = (
    "--mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 --hidden-size 64 --num-attention-heads 4"
    " --group-query-attention --num-query-groups 2 --seq-length 16 --swiglu --ffn-hidden-size 192"
    " --position-embedding-type rope --normalization RMSNorm --micro-batch-size 1 --global-batch-size 8 --lr 1e-3"
    " --hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --log-interval 100 --transformer-impl local --bf16"
    " --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather --no-fp8-calibration --use-megatron-fsdp"
    " --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer --megatron-fsdp-main-grads-dtype bf16"
    " --use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16"
)
# No data moved: views and metadata
_FREE = {"view", "_unsafe_view", "as_strided", "slice", "select", "split", "split_with_sizes", "detach", "alias"}
_FREE |= {"t", "transpose", "permute", "unsqueeze", "squeeze", "expand", "reshape", "narrow", "empty", "_to_copy?"}
_FREE |= {"set_", "resize_", "empty_strided", "lift_fresh", "is_same_size", "_local_scalar_dense", "unbind", "chunk"}

PHASE = ["forward/backward"]  # the innermost phase of the code running now
SUPPRESSED = "(eager step: one Triton kernel per tensor on CUDA)"


def _tensors(tree: object) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


class Census(TorchDispatchMode):
    """(phase, op, dtypes) -> [calls, tensors, elements, bytes]."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[tuple[str, str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])

    def record(self, phase: str, op: str, dtypes: str, tensors: int, numel: int, nbytes: int) -> None:
        row = self.rows[(phase, op, dtypes)]
        for i, value in enumerate((1, tensors, numel, nbytes)):
            row[i] += value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        phase, name = PHASE[-1], func.overloadpacket.__name__
        if phase == SUPPRESSED or name in _FREE:
            return out
        inputs = _tensors((args, kwargs))
        if name == "all_gather_copy_in":  # a _foreach_copy_ of the inputs (args[0]) into the output's slot
            ins = _tensors(args[0])
            nbytes = 2 * sum(t.nbytes for t in ins)
            dtype = str(args[1].dtype).removeprefix("torch.")
            self.record(phase, "fsdp copy-in (_foreach_copy_)", dtype, len(ins), args[1].numel(), nbytes)
            return out
        seen = {}
        for t in inputs + _tensors(out):
            if t.device.type != "meta":
                seen.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()), t)
        if not seen:
            return out
        dtypes = ",".join(sorted({str(t.dtype).replace("torch.", "") for t in seen.values()}))
        numel = max(t.numel() for t in seen.values())
        self.record(phase, name, dtypes, len(inputs), numel, sum(t.nbytes for t in seen.values()))
        return out


def _in_phase(name: str, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        PHASE.append(name)
        try:
            return fn(*args, **kwargs)
        finally:
            PHASE.pop()

    return wrapped


def _fused_bytes(census: Census):
    """Record adam_kernel's launches in place of the eager step: per tensor, grad read, states read and written,
    model copy written."""
    from megatron.optim.precision_aware import PrecisionAwareAdamW

    step = PrecisionAwareAdamW.step

    def wrapped(self, grads, lr=None, grad_scale=None, found_inf=None, model_copies=None):
        copies = model_copies or [None] * len(grads)
        for g, p, m, v, c in zip(grads, self.masters, self.exp_avg, self.exp_avg_sq, copies):
            nbytes = g.nbytes + 2 * (p.nbytes + m.nbytes + v.nbytes) + (0 if c is None else c.nbytes)
            dtypes = f"grad {g.dtype}, copy {None if c is None else c.dtype}".replace("torch.", "")
            census.record("optimizer step", "_adamw_kernel (Triton, CUDA)", dtypes, 5, g.numel(), nbytes)
        PHASE.append(SUPPRESSED)
        try:
            return step(self, grads, lr, grad_scale, found_inf, model_copies)
        finally:
            PHASE.pop()

    PrecisionAwareAdamW.step = wrapped


def _instrument(census: Census) -> None:
    from megatron.optim.optimizer import MixedPrecisionAdamW
    from megatron.parallel import grads as grads_module
    from megatron.parallel.fsdp.fp8_gather import Fp8GatherScales
    from megatron.parallel.fsdp.fsdp2 import Fsdp2Grads
    from megatron.training import steps

    MixedPrecisionAdamW.step = _in_phase("optimizer step", MixedPrecisionAdamW.step)
    Fsdp2Grads.zero = _in_phase("grad zero", Fsdp2Grads.zero)
    Fp8GatherScales.agree = _in_phase("FP8 shard amax + cast (agree)", Fp8GatherScales.agree)
    steps.grad_norm = _in_phase("grad norm", grads_module.grad_norm)
    from megatron.optim.loss_scaler import LossScaler

    LossScaler.unscale_ = _in_phase("grad unscale", LossScaler.unscale_)
    _fused_bytes(census)


def _body(rank: int, store_path: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    from megatron.config import parse_args
    from megatron.training import Trainer

    census = Census()
    _instrument(census)
    flags = f"{FLAGS} --num-layers {args.layers} --train-iters {args.steps}"
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's configuration and log lines
        trainer = Trainer(parse_args(flags.split(), world_size=2, device_type="cpu"))
        with census:
            trainer.train()
    if rank == 0:
        _print(census, trainer, args.steps, args.all)
    dist.destroy_process_group()


def _print(census: Census, trainer, steps: int, every_op: bool) -> None:
    shard = sum(p.main_grad.numel() for p in trainer.optimizer.params)
    print(f"rank 0 of 2: {shard} shard elements; per step over {steps} steps (B/el: bytes per shard element)")
    print(f"{'phase':<32} {'op':<34} {'dtypes':<30} {'calls':>6} {'tensors':>8} {'max numel':>10} {'B/el':>7}")
    totals: dict[str, float] = collections.Counter()
    for (phase, op, dtypes), (calls, tensors, numel, nbytes) in sorted(census.rows.items()):
        per = nbytes / steps / shard
        totals[phase] += per
        if phase == "forward/backward" and not every_op and not op.startswith("fsdp"):
            continue
        print(f"{phase:<32} {op:<34} {dtypes:<30} {calls / steps:6.1f} {tensors / steps:8.1f} {numel:10d} {per:7.2f}")
    print("per phase, bytes per shard element and per step (the agreement's cast is eager here, one Triton kernel")
    print("per weight on CUDA: 2 B per FP8-gathered element read for the amax, 3 for the cast):")
    for phase, per in totals.items():
        print(f"  {phase:<34} {per:7.2f} B/el  (the 8B at DP=2: {per * 4.0e9 / 1e9:6.1f} GB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--all", action="store_true", help="list every op of the forward and backward too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_body, args=(os.path.join(tmp, "store"), args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
