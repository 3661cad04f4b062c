"""Parallel layout. Data parallelism is inferred: world size / (tensor x context x pipeline)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import option, require

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
FSDP_DTYPES = ("fp32", "bf16", "fp16", "auto")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel degree (ranks that split each layer's weights)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel degree (ranks that split the layers into stages)."""
    sequence_parallel: bool = False
    """Split the regions between tensor-parallel GEMMs (norms, dropout, residual adds) along the sequence over the
    tensor-parallel ranks: all-gather before the column-parallel GEMMs, reduce-scatter after the row-parallel ones.
    With --tensor-model-parallel-size 1 there is nothing to split: turned off with a startup note, as Megatron-LM
    does (its FP8 Llama script passes it at TP=1)."""
    tp_comm_overlap: bool = False
    """Overlap the sequence-parallel all-gathers and reduce-scatters with the GEMMs that consume or produce them,
    through Transformer Engine's userbuffers (chunked GEMMs interleaved with peer-to-peer copies between the
    tensor-parallel GPUs of one node). Needs --transformer-impl transformer_engine and --sequence-parallel; set
    CUDA_DEVICE_MAX_CONNECTIONS=1 as Megatron-LM asks. Where NCCL's NVLink multicast is off (NCCL_NVLS_ENABLE=0),
    the userbuffers skip multicast too (UB_SKIPMC=1)."""
    tp_comm_bootstrap_backend: str = option("nccl", choices=["nccl", "gloo"])
    """torch.distributed backend that exchanges the userbuffers' memory handles at startup (--tp-comm-overlap)."""
    decoder_first_pipeline_num_layers: int | None = None
    """Transformer layers on the first pipeline stage (uneven split); the rest are divided evenly."""
    decoder_last_pipeline_num_layers: int | None = None
    """Transformer layers on the last pipeline stage (uneven split); the rest are divided evenly."""
    overlap_grad_reduce: bool = False
    """Start each gradient bucket's data-parallel all-reduce during the last micro-batch's backward pass, as soon as
    the bucket is complete, instead of after it (with pipeline parallelism the buckets are reduced after the
    schedule)."""
    overlap_param_gather: bool = False
    """With --use-distributed-optimizer: all-gather the updated parameters asynchronously, and let each module of
    the next forward pass wait only for its own bucket, so the gathers overlap the forward pass."""
    grad_reduce_in_bf16: bool = False
    """Keep the gradient buffers in bf16: micro-batch accumulation and the data-parallel reduction run in bf16
    (half the memory and traffic of fp32). The optimizer upcasts its part to fp32, unless --main-grads-dtype bf16
    lets the precision-aware optimizer read the bf16 gradients directly."""
    fp8_grad_reduce: bool = False
    """Send the data-parallel gradient reduction as FP8 (e4m3, a power-of-two scale per 128 values) and sum in
    fp32 on arrival: a quarter of fp32's bytes, half of bf16's (megatron/parallel/fp8_reduce.py); under FSDP each
    unit's reduce-scatter (megatron/parallel/fsdp/fp8_reduce_scatter.py). The log reports the fraction of values flushed
    to zero. --fp8-optimizer-level O1 and O2 turn it on."""
    ddp_bucket_size: int = 40_000_000
    """Gradient elements per data-parallel all-reduce bucket."""
    distributed_backend: str | None = option(None, choices=["nccl", "gloo"])
    """torch.distributed backend; defaults to nccl on CUDA and gloo on CPU."""
    distributed_timeout_minutes: int = 10
    """Timeout of torch.distributed in minutes: of the default process group and of every group built from it
    (tensor, pipeline, data parallel, ...); a collective that waits longer fails."""
    context_parallel_size: int = 1
    """Ranks that split each sequence (context parallelism): the sequence is cut into 2 x this many chunks and each
    rank keeps two (one early, one late: the same causal-attention work everywhere), for the tokens, labels, loss
    mask and positions alike; attention exchanges keys and values over the group; gradients are averaged over data
    x context parallel ranks. --seq-length must be divisible by 2 x this."""
    cp_comm_type: list[str] = option(["p2p"], nargs="+")
    """How Transformer Engine's attention exchanges keys and values over the context-parallel ranks: p2p (a ring of
    point-to-point sends, overlapped with the attention), all_gather, or a2a (all-to-all: heads scattered, the
    sequence gathered; the heads per tensor-parallel rank must divide by the context-parallel size); one value, or
    one per layer. a2a+p2p needs --hierarchical-context-parallel-sizes, which does not exist here. The local
    attention (--transformer-impl local, --attention-backend local) all-gathers keys and values whatever this says:
    the same result, without TE's overlap."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Transformer layers per virtual pipeline stage: each pipeline rank holds (layers per rank) / this many model
    chunks and runs the interleaved 1F1B schedule, whose pipeline bubble is that many times smaller (at as many
    times the point-to-point traffic). Chunk c of rank r is virtual stage c * PP + r. Needs
    --pipeline-model-parallel-size > 1 when it makes more than one chunk, and a number of micro-batches per step
    that is a multiple of the pipeline size; with --decoder-first/last-pipeline-num-layers use
    --num-virtual-stages-per-pipeline-rank instead."""
    num_virtual_stages_per_pipeline_rank: int | None = None
    """Model chunks (virtual pipeline stages) per pipeline rank for the interleaved 1F1B schedule (the other way to
    ask for it than --num-layers-per-virtual-pipeline-stage; give one of the two). Each rank's layers, also those of
    an uneven first or last stage, must divide evenly over its chunks."""
    microbatch_group_size_per_virtual_pipeline_stage: int | None = None
    """Interleaved schedule: micro-batches that each virtual stage runs in a row (forward, and backward) before the
    next chunk takes them; default the pipeline size (depth-first). Between --pipeline-model-parallel-size and the
    micro-batches per step, and those must be a multiple of it or leave a last group of at least the pipeline
    size. Larger groups keep more micro-batches' activations in flight."""
    pipeline_model_parallel_layout: str | None = None
    """Which layers each virtual pipeline stage holds, as in Megatron-LM: stages separated by `|` in model order, `E`
    the embedding (opens the first stage), `t` a transformer layer, `L` the output layer and loss (closes the last),
    `x*n` and `(...)*n` repeat, commas are cosmetic; the stage count over --pipeline-model-parallel-size is the
    virtual pipeline size. For stages of unequal work, e.g. a last stage whose large-vocabulary output layer costs
    about two layers: `Et*4|t*4|t*5|t*4|t*4|t*4|t*4|t*3L` (megatron/config/pipeline_split.py). Replaces
    --decoder-first/last-pipeline-num-layers and the virtual pipeline flags. A stage may hold only E or only L."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one transformer layer when the layers are split over the pipeline (Megatron-LM's
    flag): the first virtual stage builds one layer fewer (none: the embedding alone). The layers plus those counted
    must divide evenly over pipeline x virtual stages."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as one transformer layer in the pipeline split: the last virtual stage builds
    one layer fewer."""

    use_megatron_fsdp: bool = False
    """Shard the data-parallel state as --data-parallel-sharding-strategy says (default optim_grads_params: weights,
    gradients and optimizer states). Megatron-LM's flag. optim_grads runs on this project's flat-buffer engine
    (megatron/parallel/fsdp/flat_shards.py: the distributed optimizer's buckets, each micro-batch's gradients
    reduce-scattered into persistent fp32 shards, no whole-model gradient buffer kept); optim_grads_params runs on
    PyTorch's FSDP2 (`fully_shard` over DTensor, megatron/parallel/fsdp/fsdp2.py), as --use-torch-fsdp2: each
    transformer layer is one unit (all-gathered before it runs, freed after), the embedding another, the final norm and
    output layer a last one that stays gathered from its forward to its backward."""
    use_torch_fsdp2: bool = False
    """PyTorch's FSDP2 (megatron/parallel/fsdp/fsdp2.py) for every sharding strategy, optim_grads included (which
    --use-megatron-fsdp runs on the flat-buffer engine instead)."""
    data_parallel_sharding_strategy: str | None = option(None, choices=list(SHARDING_STRATEGIES))
    """What the data-parallel ranks shard, with --use-megatron-fsdp / --use-torch-fsdp2 (default optim_grads_params,
    Megatron-LM's): no_shard (plain data parallelism: whole gradient buffers all-reduced), optim (the distributed
    optimizer: optimizer states sharded, as --use-distributed-optimizer), optim_grads (also the gradients: each
    micro-batch's gradients are reduce-scattered into fp32 shards, no whole-model gradient buffer; the weights are
    gathered once per step and kept whole from the first forward to the last backward; with --use-megatron-fsdp on
    the distributed optimizer's flat buckets, each allocated only while its gradients are formed and reduced, and
    with the distributed optimizer's state layout and checkpoints; with --use-torch-fsdp2 on FSDP2's units),
    optim_grads_params (also the weights: each unit is gathered before its forward and again before its backward,
    and freed after each; FSDP2)."""
    fsdp_double_buffer: bool = False
    """FSDP: gather the next unit's weights while the current one computes, in both passes (explicit prefetch of
    one unit: two units' gathered weights are held at a time). Without it FSDP2 still issues each gather ahead
    when the host runs ahead of the device, and prefetches one unit in the backward."""
    torch_fsdp2_reshard_after_forward: bool = option(
        True, flag="--torch-fsdp2-no-reshard-after-forward", action="store_false"
    )
    """--use-torch-fsdp2 (Megatron-LM's flag, which sets FSDP2's `reshard_after_forward=False`: its "ZeRO-2"): keep
    each unit's gathered weights from its forward to its backward instead of freeing them after the forward and
    gathering them again for the backward. Under optim_grads_params each unit is then gathered once per micro-batch
    instead of twice (half the layers' all-gathers), and freed after its backward, so between steps a rank holds only
    its shards; the cost is memory: at the end of each micro-batch's forward, the activation peak, every unit is
    gathered (the whole model in the training dtype, as under optim_grads). Forwards without a backward (evaluation)
    free the units at their end. Under optim_grads the weights are kept for the whole step already, so the flag is
    accepted and changes nothing (a Megatron-LM user passing it asks for at least that). Megatron-LM reads it only
    for torch FSDP2: with --use-megatron-fsdp alone, or without FSDP, it is an error naming --use-torch-fsdp2."""
    suggested_communication_unit_size: int | None = None
    """FSDP: parameter elements per communication unit: consecutive transformer layers are grouped into one unit
    (one all-gather, one reduce-scatter) until it holds at least this many; default one layer per unit. Larger
    units mean fewer, larger collectives and more gathered memory."""
    megatron_fsdp_main_params_dtype: str = option("fp32", choices=list(FSDP_DTYPES))
    """FSDP: dtype of the sharded main weights the optimizer steps on (Megatron-LM's flag; auto: the model's dtype).
    fp32 is built: the shards are the fp32 main weights, and each unit is gathered in the training dtype (bf16
    under --bf16). With --use-precision-aware-optimizer (fp32 or auto) the optimizer holds each shard's main weights
    itself, in --main-params-dtype (fp16 keeps an int8 remainder: ~19 significant bits), and the shards hold
    the training dtype, gathered without a cast."""
    megatron_fsdp_main_grads_dtype: str = option("auto", choices=list(FSDP_DTYPES))
    """FSDP: dtype of the sharded gradients the micro-batches accumulate into: fp32, or bf16 (half the bytes; the
    optimizer upcasts them one step at a time, as with --grad-reduce-in-bf16); auto: fp32, bf16 with
    --grad-reduce-in-bf16."""
    megatron_fsdp_grad_comm_dtype: str = option("auto", choices=list(FSDP_DTYPES))
    """FSDP: dtype of the gradient reduce-scatter, fp32 or bf16 (auto: that of the gradient shards,
    --megatron-fsdp-main-grads-dtype)."""
    init_model_with_meta_device: bool = False
    """FSDP: build the model without storage (PyTorch's meta device), shard it, then give each rank its shards'
    values unit by unit, the same values as an ordinary initialization for the seed: no rank holds the whole model.
    Under --use-megatron-fsdp's optim_grads, whose ranks hold every weight, the model gets its storage on the device
    and its values a part at a time, so that the host never holds the whole model."""

    @property
    def gradient_engine(self) -> str:
        """The gradient engine the flags choose, once the strategy is resolved (config/sharding.py; the table in
        megatron/parallel/engines.py): "fsdp2" where PyTorch's FSDP2 holds the parameters (strategy optim_grads or
        optim_grads_params, except optim_grads under --use-megatron-fsdp alone), "flat_shards" for that exception
        (the distributed optimizer's flat buckets, each micro-batch's gradients reduce-scattered into shards), else
        "buffers" (whole gradient buckets, with or without the distributed optimizer)."""
        strategy = self.data_parallel_sharding_strategy
        if strategy == "optim_grads" and self.use_megatron_fsdp and not self.use_torch_fsdp2:
            return "flat_shards"
        return "fsdp2" if strategy in ("optim_grads", "optim_grads_params") else "buffers"

    def _given(self, *names: str) -> list[str]:
        """The flags of `names` that were given (neither None nor a switch left off), as written on the command
        line, for messages."""
        given = [name for name in names if getattr(self, name) is not None and getattr(self, name) is not False]
        return ["--" + name.replace("_", "-") for name in given]

    def finalize(self) -> None:
        require(self.tensor_model_parallel_size >= 1, "--tensor-model-parallel-size must be >= 1")
        require(self.pipeline_model_parallel_size >= 1, "--pipeline-model-parallel-size must be >= 1")
        require(
            not self.tp_comm_overlap or (self.sequence_parallel and self.tensor_model_parallel_size > 1),
            "--tp-comm-overlap overlaps the sequence-parallel collectives with the GEMMs: add --sequence-parallel"
            " (and --tensor-model-parallel-size > 1)",
        )
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            require(value is None or value >= 1, f"{flag} must be >= 1")
            require(
                value is None or self.pipeline_model_parallel_size > 1,
                f"{flag} needs --pipeline-model-parallel-size > 1",
            )
        require(self.ddp_bucket_size >= 1, "--ddp-bucket-size must be >= 1")
        require(self.distributed_timeout_minutes >= 1, "--distributed-timeout-minutes must be >= 1")
        require(self.context_parallel_size >= 1, "--context-parallel-size must be >= 1")
        for value in self.cp_comm_type:
            require(value in CP_COMM_TYPES, f"--cp-comm-type {value}: choose from {', '.join(CP_COMM_TYPES)}")
        require(
            "a2a+p2p" not in self.cp_comm_type,
            "--cp-comm-type a2a+p2p (hierarchical context parallelism) needs --hierarchical-context-parallel-sizes,"
            " which is not implemented; use p2p, all_gather or a2a",
        )
        for name in (
            "num_layers_per_virtual_pipeline_stage",
            "num_virtual_stages_per_pipeline_rank",
            "microbatch_group_size_per_virtual_pipeline_stage",
        ):
            value = getattr(self, name)
            require(value is None or value >= 1, f"--{name.replace('_', '-')} must be >= 1")
        accounted = self._given("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
        uneven = self._given("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
        require(not (accounted and uneven), f"{', '.join(accounted)} with {', '.join(uneven)}: give one")
        if self.pipeline_model_parallel_layout is not None:
            virtual = self._given("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
            require(
                not (uneven + virtual + accounted),
                "--pipeline-model-parallel-layout places every layer itself: drop"
                f" {', '.join(uneven + virtual + accounted)}",
            )
        require(
            self.num_layers_per_virtual_pipeline_stage is None or self.num_virtual_stages_per_pipeline_rank is None,
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank both set the virtual"
            " pipeline size: give one of them",
        )
