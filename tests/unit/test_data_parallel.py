"""GradientBuffers' overlapped parameter all-gather (--overlap-param-gather): each module of the forward pass waits
for the all-gathers of its own buckets just before it runs, and no earlier. The gathers are stand-ins here, so the
order is checked deterministically (tests/distributed checks the numbers with real gloo gathers)."""

import torch

from megatron.config import parse_args
from megatron.model import GPTModel
from megatron.parallel import GradientBuffers

FLAGS = "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 --mock-data"


class _PendingGather:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


def test_each_module_waits_for_its_buckets_only_when_it_runs():
    cfg = parse_args(FLAGS.split())
    model = GPTModel(cfg.model, 64)
    # ~one bucket per layer (buckets fill in reverse parameter order: the last layers first)
    buffers = GradientBuffers(model, None, bucket_size=5000, shard=True, overlap_param_gather=True)
    layers = list(model.decoder.layers)
    buffers.wait_for_params_in_forward(model, layers)
    assert len(buffers.buckets) >= 3
    for bucket in buffers.buckets:
        bucket.gather = _PendingGather()
    pending = {id(b): b.gather for b in buffers.buckets}
    bucket_of = buffers._bucket_of
    seen = []

    def check(layer, args):  # registered after the buffers' hook, so it runs after it
        own = {id(bucket_of[p]) for p in layer.parameters()}
        assert all(pending[b].waited for b in own), "a layer ran before its parameters were gathered"
        later = {id(bucket_of[p]) for later in layers[layer.layer_number :] for p in later.parameters()} - own
        assert not any(pending[b].waited for b in later), "a later layer's gather was waited for too early"
        seen.append(layer.layer_number)

    for layer in layers:
        layer.register_forward_pre_hook(check)
    tokens = torch.randint(0, 64, (2, 16))
    model(tokens, labels=tokens)
    assert seen == [1, 2, 3]
    assert all(g.waited for g in pending.values()) and all(b.gather is None for b in buffers.buckets)
