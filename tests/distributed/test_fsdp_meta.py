"""--init-model-with-meta-device with the local FP8 engine under FSDP (optim_grads_params, DP=2): delayed and
tensorwise scaling, with and without --fp8-param-gather. The FP8 state (amax histories, scales, the all-gather scales)
is made on the run's device while the weights exist only on the meta device, and FSDP gives the weights storage
shard by shard: the meta-built run starts from the eager run's weights, parameter attributes and FP8 state bit for
bit and trains to the same losses, each rank building the model without storage and then no more than one layer's
parameters at once. (tests/gpu/test_te_fsdp_meta.py runs the same comparison with Transformer Engine's layers.)"""

import torch

from megatron.model import meta_init
from megatron.parallel.fsdp.fp8_gather import Fp8ShardWeight
from megatron.parallel.fsdp.fsdp2 import local_shard
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import BASE, FP8, TENSORWISE, _parse

STEPS = 3
PARAMS = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
FLAGS = f"{BASE} --train-iters {STEPS} --eval-iters 0 --bf16 {PARAMS}"


def record_deferred_builds() -> list[tuple[bool, int]]:
    """From now on in this process, each --init-model-with-meta-device build appends (whether the parameters of the
    model it built held no storage, the most parameter elements one part built to fill it held)."""
    builds = []
    init, fill = meta_init.DeferredInit.__init__, meta_init.DeferredInit.__call__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.built_on_meta = all(p.is_meta for p in self.model.parameters())

    def recording_fill(self, model):
        fill(self, model)
        builds.append((self.built_on_meta, self.largest_part))

    meta_init.DeferredInit.__init__, meta_init.DeferredInit.__call__ = recording_init, recording_fill
    return builds


def _fp8_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The local FP8 engine's state tensors (its amax state) and, under --fp8-param-gather, each FP8 weight's
    all-gather scale (local and TE linears)."""
    amax = trainer.fp8.amax if trainer.fp8 is not None else None
    state = vars(amax) if amax is not None else {}  # TE's layers keep their FP8 state themselves
    tensors = {name: t for name, t in state.items() if isinstance(t, torch.Tensor)}
    for name, param in trainer.model.named_parameters():
        if isinstance(shard := local_shard(param), Fp8ShardWeight):
            tensors |= {f"{name}.{k}": t for k, t in vars(shard._scale).items() if isinstance(t, torch.Tensor)}
    return tensors


def _attributes(param: torch.Tensor) -> dict[str, object]:
    """The parallel attributes the gradient, optimizer and checkpoint code read: values, not the gradient shard or an
    FP8 weight's linear state (each run's own object)."""
    values = (bool, int, float, str, tuple, torch.dtype, type(None))
    return {k: v for k, v in vars(param).items() if not k.startswith("_") and isinstance(v, values)}


def compare_meta_to_eager(flags: str, world_size: int, builds: list[tuple[bool, int]]) -> tuple[list, list]:
    """Build the run of `flags` eagerly and with --init-model-with-meta-device; check that the meta build starts from
    the eager one's weight shards, parameter attributes and FP8 state bit for bit (on the run's device), and built
    nothing but one part at a time (`builds`: from `record_deferred_builds`); return both runs' losses (meta, eager)."""
    eager = Trainer(_parse(flags, world_size))
    meta = Trainer(_parse(f"{flags} --init-model-with-meta-device", world_size))
    device = eager.device.type
    for (name, a), (_, b) in zip(eager.model.named_parameters(), meta.model.named_parameters(), strict=True):
        assert _attributes(a) == _attributes(b), (flags, name, _attributes(a), _attributes(b))
        a, b = local_shard(a), local_shard(b)
        assert type(a) is type(b) and b.device.type == device and torch.equal(a, b), (flags, name)
    want, got = _fp8_tensors(eager), _fp8_tensors(meta)
    assert want.keys() == got.keys(), flags
    for name, tensor in got.items():
        assert tensor.device.type == device and torch.equal(tensor, want[name]), (flags, name)
    # Nothing allocated for the model at first, then one layer at a time (the largest part), never the whole model
    built_on_meta, largest_part = builds.pop()
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in eager.model.decoder.layers)
    assert built_on_meta and largest_part == largest < sum(p.numel() for p in eager.model.parameters()) / 2, flags
    return list(meta.train().losses.values()), list(eager.train().losses.values())


def _body(rank, world_size):
    builds = record_deferred_builds()
    for recipe in (FP8, TENSORWISE):
        for gather in ("", "--fp8-param-gather"):
            flags = f"{FLAGS} {recipe} {gather}"
            got, want = compare_meta_to_eager(flags, world_size, builds)
            assert len(got) == STEPS and got == want, (flags, got, want)


def test_meta_device_init_with_local_fp8():
    run_distributed(_body, world_size=2)


WHOLE = {  # the strategies whose ranks hold every weight: the model gets its storage and values before the buckets
    "optim_grads": ["", "--fp8-param-gather"],  # the flat-bucket engine (ZeRO-2)
    "optim": ["--fp8-param-gather"],  # the distributed optimizer
    "no_shard": [""],  # DDP's buckets
}


def _whole_body(rank, world_size):
    builds = record_deferred_builds()
    for strategy, gathers in WHOLE.items():
        for gather in gathers:
            flags = f"{BASE} --train-iters {STEPS} --eval-iters 0 --bf16 --use-megatron-fsdp {FP8} {gather}"
            flags += f" --data-parallel-sharding-strategy {strategy}"
            got, want = compare_meta_to_eager(flags, world_size, builds)
            assert len(got) == STEPS and got == want, (flags, got, want)


def test_meta_device_init_where_every_rank_holds_every_weight():
    run_distributed(_whole_body, world_size=2)
