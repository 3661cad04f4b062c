"""FSDP with --fp8-param-gather (optim_grads_params, 2 gloo ranks, two micro-batches per rank and step) casts each
FP8 weight's shard once per optimizer step, when the ranks agree its scale
(megatron/parallel/fsdp/fp8_gather_scales.py), and never at an all-gather, although each unit is gathered 4 times
per step: tensorwise and blockwise (whose shards start inside a 128-row block). Every all-gather sends the bytes a
cast of the shard made there and then would (the uncached path's: same scale, same rounding), pad rows zero, handed
to FSDP2 as bf16 (the units' gather dtype), and the bytes change from step to step. A checkpoint loaded into a model
that has already cast its shards for a step makes them cast again from the loaded shards."""

import torch

from megatron.parallel.fsdp.fp8_gather import Fp8ShardWeight, GatherScale, gathered_bytes, shard_rows
from megatron.training import Trainer
from megatron.training.data_loading import to_device
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import BASE, TENSORWISE, _parse

STEPS = 3
PARAMS = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
FLAGS = f"{BASE} --train-iters {STEPS} --eval-iters 0 --bf16 --fp8-param-gather {PARAMS}"
BLOCKWISE = " --fp8-format hybrid --fp8-recipe blockwise --lr 1e-3 --no-fp8-first-layer-bf16 --ffn-hidden-size 160"


class Watch:
    """Counts `GatherScale.fill` calls (in and out of all-gathers) and all-gathers, and checks each all-gather's
    bytes against a cast of the shard made at that moment."""

    def __init__(self) -> None:
        self.fills = self.fills_in_gathers = self.gathers = 0
        self.in_gather = False
        self.sent: dict[int, list[torch.Tensor]] = {}  # id(scale): the bytes of each gather
        self.dtypes: set[torch.dtype] = set()  # what the bytes were handed to FSDP2 as
        fill, gather = GatherScale.fill, Fp8ShardWeight.fsdp_pre_all_gather

        def counted_fill(scale, *args, **kwargs):
            self.fills += 1
            self.fills_in_gathers += self.in_gather
            return fill(scale, *args, **kwargs)

        def checked_gather(shard, mesh, orig_size, orig_stride, module, mp_policy):  # FSDP2 reads the signature
            self.in_gather = True
            try:
                (sent,), metadata = gather(shard, mesh, orig_size, orig_stride, module, mp_policy)
            finally:
                self.in_gather = False
            data = gathered_bytes(sent)  # sent as the unit's gather dtype (fsdp_params.gather_view)
            self.dtypes.add(sent.dtype)
            rows, n = shard_rows(orig_size[0], mesh.size()), shard._tensor.shape[0]
            first_row = mesh.get_local_rank() * rows
            assert data.shape == (rows, *shard._tensor.shape[1:]) and not data[n:].any()
            now = shard._scale.cast(shard._tensor, first_row).view(torch.uint8)  # the uncached path's bytes
            assert torch.equal(data[:n], now), "an all-gather sent bytes other than the shard's cast now"
            self.gathers += 1
            self.sent.setdefault(id(shard._scale), []).append(data.clone())
            return (sent,), metadata

        GatherScale.fill, Fp8ShardWeight.fsdp_pre_all_gather = counted_fill, checked_gather
        self._undo = lambda: (
            setattr(GatherScale, "fill", fill) or setattr(Fp8ShardWeight, "fsdp_pre_all_gather", gather)
        )

    def close(self) -> None:
        self._undo()


def _fp8_weights(trainer: Trainer) -> int:
    return len(trainer.optimizer.buffers.fp8_scales.shards)


def _forward(trainer: Trainer) -> None:
    batch = next(iter(trainer.loader(trainer.datasets.train, 0)))
    with torch.no_grad():
        trainer.steps.loss(to_device(batch, trainer.device))


def _body(rank, world_size, out_dir):
    for recipe in (TENSORWISE, BLOCKWISE):
        watch = Watch()
        try:
            trainer = Trainer(_parse(f"{FLAGS} {recipe}", world_size))
            trainer.train()
        finally:
            watch.close()
        weights = _fp8_weights(trainer)
        assert weights == 16, weights  # 4 linears in each of 4 FP8 layers
        # once per weight and step, at the agreement; each unit gathered for forward and backward, 2 micro-batches,
        # but the last layer's (4 weights) for the forward only: it stays gathered for its backward
        assert (watch.fills, watch.fills_in_gathers) == (weights * STEPS, 0), (recipe, watch.fills)
        assert watch.gathers == ((weights - 4) * 2 * 2 + 4 * 2) * STEPS, (recipe, watch.gathers)
        # as bf16 pairs, the dtype of the units' other weights: one dtype per unit, so FSDP2's copy-in does not move
        # the whole unit as bytes (the ranks divide every weight's rows here)
        assert watch.dtypes == {torch.bfloat16}, (recipe, watch.dtypes)
        for sent in watch.sent.values():  # one step's gathers send the same bytes, the next step's others
            n = len(sent) // STEPS
            steps = [sent[i : i + n] for i in range(0, len(sent), n)]
            assert all(torch.equal(s[0], t) for s in steps for t in s[1:]), recipe
            assert all(not torch.equal(a[0], b[0]) for a, b in zip(steps, steps[1:])), recipe

    # A checkpoint loaded after this step's cast: the next forward's gathers send the loaded shards' cast
    flags = f"{FLAGS} {TENSORWISE} --ckpt-format torch_dist"
    Trainer(_parse(f"{flags} --train-iters 1 --save {out_dir}/one", world_size)).train()
    trainer = Trainer(_parse(f"{flags} --save {out_dir}/three --save-interval 100", world_size))
    trainer.train()
    watch = Watch()
    try:
        _forward(trainer)  # casts the trained shards (the step's agreement)
        before = watch.fills
        trainer.checkpointer.load(f"{out_dir}/one")
        _forward(trainer)  # `Watch` asserts each gather's bytes are the loaded shards' cast
    finally:
        watch.close()
    assert watch.fills - before == _fp8_weights(trainer) and watch.fills_in_gathers == 0, watch.fills


def test_fsdp_fp8_gather_casts_each_shard_once_per_step(tmp_path):
    run_distributed(_body, world_size=2, args=(str(tmp_path),))
