"""FSDP's host work per micro-batch under optim_grads (llama-1b's FSDP step is host-bound on two H100s;
scripts/probes/host_overhead.py measures it on the CPU). With four micro-batches per step at DP=2:

* units of two layers give bitwise the losses of one-layer units: only the grouping of each reduce-scatter changes,
  not any element's reduction, so the unit size is a knob on FSDP2's per-unit host work alone (the benchmark's
  fsdp2_optim_grads_units* layouts);
* each unit is all-gathered once per step (kept from the first forward to the last backward) and resharded after
  it, and FSDP2 is told to switch resharding twice per step, once per unit (not every micro-batch, and without
  walking the model's modules)."""

from torch.distributed.fsdp import FSDPModule

from megatron.parallel.fsdp import fsdp2_internals as internals
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import _counted, _gathered_bytes

STEPS = 3
FLAGS = (
    "--mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 --num-layers 4 --hidden-size 32"
    " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --seq-length 16 --swiglu"
    " --ffn-hidden-size 64 --position-embedding-type rope --normalization RMSNorm --micro-batch-size 2"
    " --global-batch-size 16 --lr 1e-2 --hidden-dropout 0 --attention-dropout 0 --eval-iters 0"
    " --log-interval 100 --transformer-impl local --bf16 --untie-embeddings-and-output-weights"
    f" --train-iters {STEPS} --use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads --fsdp-double-buffer"
)
TWO_LAYERS = "--suggested-communication-unit-size 10000"  # about 9.3k elements per layer


def _units(model) -> int:
    """FSDP units holding parameters (the root holds none with untied embeddings)."""
    return sum(1 for unit in internals.units(model) if internals.param_group(unit) is not None)


def _body(rank, world_size):
    switches = []
    switch = FSDPModule.set_reshard_after_backward

    def counting(self, reshard_after_backward, *, recurse=True):
        switches.append((reshard_after_backward, recurse))
        return switch(self, reshard_after_backward, recurse=recurse)

    FSDPModule.set_reshard_after_backward = counting
    try:
        want, sent, _, trainer = _counted(FLAGS, world_size)
    finally:
        FSDPModule.set_reshard_after_backward = switch
    assert trainer.cfg.num_micro_batches == 4
    units = len(trainer.grad_buffers._units)
    assert len(sent) == STEPS * _units(trainer.model), (len(sent), _units(trainer.model))
    assert _gathered_bytes(trainer.model) == 0
    # per step: every unit off at the first micro-batch, on at the last; none recursing through the model
    assert switches == STEPS * (units * [(False, False)] + units * [(True, False)]), switches

    got, sent, _, trainer = _counted(f"{FLAGS} {TWO_LAYERS}", world_size)
    assert got == want, (got, want)  # bitwise
    assert len(sent) == STEPS * _units(trainer.model) == STEPS * 4  # embedding, two layer units, output
    assert _gathered_bytes(trainer.model) == 0


def test_optim_grads_gathers_once_switches_twice_and_unit_size_keeps_the_losses():
    run_distributed(_body, world_size=2)
