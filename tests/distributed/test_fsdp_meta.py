"""--init-model-with-meta-device with the local FP8 engine under FSDP (optim_grads_params, DP=2): delayed and
tensorwise scaling, with and without --fp8-param-gather. The FP8 state (amax histories, scales, the all-gather scales)
is made on the run's device while the weights exist only on the meta device, and FSDP gives the weights storage
shard by shard: the meta-built run starts from the eager run's weights and FP8 state bit for bit and trains to the
same losses, no rank building more than one layer's parameters at once."""

import torch

from megatron.fp8.fsdp_params import Fp8ShardWeight
from megatron.model import meta_init
from megatron.parallel.fsdp import local_shard
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import BASE, FP8, TENSORWISE, _parse

STEPS = 3
PARAMS = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
FLAGS = f"{BASE} --train-iters {STEPS} --eval-iters 0 --bf16 {PARAMS}"


def _fp8_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The FP8 state's tensors: the amax state and, under --fp8-param-gather, each weight's all-gather scale."""
    amax = trainer.fp8.amax
    tensors = {name: t for name, t in vars(amax).items() if isinstance(t, torch.Tensor)}
    for name, param in trainer.model.named_parameters():
        if isinstance(shard := local_shard(param), Fp8ShardWeight):
            tensors |= {f"{name}.{k}": t for k, t in vars(shard._scale).items() if isinstance(t, torch.Tensor)}
    return tensors


def _body(rank, world_size):
    parts = []  # the most parameter elements a rank built at once, per initialization
    fill = meta_init.DeferredInit.__call__
    meta_init.DeferredInit.__call__ = lambda self, model: (fill(self, model), parts.append(self.largest_part))[0]
    for recipe in (FP8, TENSORWISE):
        for gather in ("", "--fp8-param-gather"):
            label = f"{recipe} {gather}"
            eager = Trainer(_parse(f"{FLAGS} {recipe} {gather}", world_size))
            meta = Trainer(_parse(f"{FLAGS} {recipe} {gather} --init-model-with-meta-device", world_size))
            for (name, a), b in zip(eager.model.named_parameters(), meta.model.parameters()):
                a, b = local_shard(a), local_shard(b)
                assert type(a) is type(b) and b.device.type == "cpu" and torch.equal(a, b), (label, name)
            want, got = _fp8_tensors(eager), _fp8_tensors(meta)
            assert want.keys() == got.keys() and got, label
            for name, tensor in got.items():
                assert tensor.device.type == "cpu" and torch.equal(tensor, want[name]), (label, name)
            # One layer at a time (the largest part), never the whole model
            largest = max(sum(p.numel() for p in layer.parameters()) for layer in eager.model.decoder.layers)
            assert parts.pop() == largest < sum(p.numel() for p in eager.model.parameters()) / 2, label
            losses = list(meta.train().losses.values())
            assert len(losses) == STEPS and losses == list(eager.train().losses.values()), label


def test_meta_device_init_with_local_fp8():
    run_distributed(_body, world_size=2)
