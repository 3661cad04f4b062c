"""Sharded data parallelism: the gradient engines that shard gradients, and the FP8 all-gather of sharded weights.

fsdp2.py                PyTorch's FSDP2 (`fully_shard`) holds the parameters: units, gradient shards, FP8 gathers
flat_shards.py          the distributed optimizer's flat buckets, each micro-batch reduce-scattered into gradient
                        shards (ZeRO-2; --use-megatron-fsdp's optim_grads)
fp8_reduce_scatter.py   FSDP2's gradient reduce-scatter sent as FP8 (--fp8-grad-reduce)
fp8_gather.py           FP8 all-gather of the local FP8 linears' weight shards (one scale per tensor or 128x128 block)
fp8_gather_scales.py    the step's agreement on their scales: one all-reduce, one cast per step, shards freed
fp8_gather_axes.py      the same for rowwise and mxfp8, cast along both axes of the weight
te_fp8_gather.py        Transformer Engine's linears' FP8-gathered weights (Float8Tensor)
te_blockwise_gather.py  Transformer Engine's blockwise FP8-gathered weights (Float8BlockwiseQTensor)
"""
