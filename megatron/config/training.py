"""Training schedule, checkpointing and logging."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .base import option, require

EXIT_SIGNALS = ["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"]
"""What --exit-signal can name."""


@dataclass
class TrainingConfig:
    micro_batch_size: int = 4
    """Samples per forward/backward pass on one data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks (gradient accumulation makes up the difference);
    defaults to micro-batch size x data-parallel size."""
    train_iters: int | None = None
    """Number of optimizer steps to train for (iteration-based training). Give this or --train-samples, not both;
    with neither, 100."""
    train_samples: int | None = None
    """Train until this many samples are consumed (sample-based training, instead of --train-iters): the number of
    steps follows from the batch-size schedule, dropping a last partial batch when the batch size is constant
    (Megatron-LM's rule). The learning-rate flags are then in samples too (--lr-warmup-samples,
    --lr-decay-samples, --lr-wsd-decay-samples)."""
    rampup_batch_size: list[int] | None = option(None, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"))
    """Ramp the global batch size up: start at START, grow by INCREMENT in equal shares of the first SAMPLES
    consumed samples, and reach --global-batch-size after them; (--global-batch-size - START) must be a
    multiple of INCREMENT. E.g. 16 8 300000 with --global-batch-size 1024: 126 increments of ~2381 samples each.
    (Megatron-LM's meaning; its latest versions deprecate the flag for --step-batch-size-schedule.)"""
    step_batch_size_schedule: str | None = option(None, nargs="+")
    """Step-wise global batch size, "THRESHOLD:BATCH THRESHOLD:BATCH ...": from THRESHOLD consumed *tokens* on
    (converted to samples by integer division by --seq-length) the global batch size is BATCH. Thresholds and
    sizes take the suffixes K (1e3), M (1e6), B (1e9), T (1e12); the first threshold must be 0. E.g.
    "0:16 2.4B:320 4.8B:624". Each batch size in use must be a multiple of --micro-batch-size x data-parallel
    size (checked for the part of the schedule a run reaches). --global-batch-size may be given too only if it
    equals the last batch size (Megatron-LM refuses both). Also as separate words (what a bash script passing it
    in an unquoted array expansion gives, e.g. Megatron-LM's GPT-3 175B example)."""
    eval_interval: int = 1000
    """Run validation every this many iterations (and at the end)."""
    eval_iters: int = 10
    """Validation batches (of global-batch size) per validation run; 0 turns validation off."""
    full_validation: bool = False
    """Every validation run reads the whole validation split, the same samples each time, from its first sample
    (one pass over its documents, rounded down to whole global batches), instead of the next --eval-iters global
    batches: evaluations then compare like with like across iterations and across runs of one seed (Megatron-LM's
    flag). The test split still reads --eval-iters batches."""
    seed: int = 1234
    """Random seed for initialization, dropout and data order."""
    deterministic_mode: bool = False
    """Bitwise reproducible runs, slower: torch.use_deterministic_algorithms(True) (PyTorch then picks only
    deterministic SDPA kernels, and raises on an op that has none), and unless already set in the environment
    NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (Transformer Engine skips non-deterministic attention backends),
    CUBLAS_WORKSPACE_CONFIG=:4096:8 and NCCL_ALGO=Ring; values already set must be deterministic ones. Not with
    --tp-comm-overlap or --cross-entropy-loss-fusion (Megatron-LM's rules). Applied when training starts."""
    exit_interval: int | None = None
    """Stop (after saving a checkpoint when --save is set) at the first iteration divisible by this value; the
    learning-rate schedule still follows --train-iters, so a later --load continues the same run."""
    exit_duration_in_mins: int | None = None
    """Stop once this many minutes have passed since the program started (a job's time limit): checked after
    every step, all ranks agree through one all-reduce so they stop after the same step, a checkpoint is saved when
    --save is set, the final evaluation is skipped and the program exits normally (status 0). 0 or unset: no
    limit."""
    exit_signal_handler: bool = False
    """Stop cleanly on --exit-signal (what Slurm sends at preemption or at the time limit, e.g. `#SBATCH
    --signal=B:USR1@120`): the handler only records the signal; the current step finishes, all ranks agree after it
    through the one all-reduce per step that --exit-duration-in-mins uses (so a signal that reached one rank stops
    every rank after the same step), a checkpoint is saved when --save is set, the final evaluation is skipped and
    the program exits with status 0. Further signals while it saves are recorded and ignored."""
    exit_signal: str = option("SIGTERM", choices=EXIT_SIGNALS)
    """The signal --exit-signal-handler handles."""
    check_for_nan_in_loss_and_grad: bool = option(
        True, flag="--no-check-for-nan-in-loss-and-grad", action="store_false"
    )
    """Stop a diverged run: a step whose loss or gradient norm is not finite is skipped (as always) and, after
    --max-consecutive-skipped-iterations such steps in a row, the run stops with a one-line error and exit status 3,
    saving nothing (the last good checkpoint stays the latest). fp16: steps skipped while the loss scaler backs off
    count only once the scale is at --min-loss-scale. `--no-check-for-nan-in-loss-and-grad`: skip such steps and go
    on. (Megatron-LM raises at the first non-finite loss or gradient norm.)"""
    max_consecutive_skipped_iterations: int = 10
    """With --check-for-nan-in-loss-and-grad: how many non-finite steps in a row stop the run (1: the first one,
    as Megatron-LM does)."""
    manual_gc: bool = False
    """Turn Python's automatic garbage collector off and collect at fixed points instead (before training, every
    --manual-gc-interval steps, around each evaluation), so that every rank collects at the same step and no rank
    stalls the others' collectives with a collection of its own."""
    manual_gc_interval: int = 0
    """With --manual-gc: collect every this many steps; 0: only before training and around evaluation."""
    manual_gc_eval: bool = option(True, flag="--no-manual-gc-eval", action="store_false")
    """With --manual-gc: do not collect around evaluations (by default a full collection before each and a
    young-generation one after)."""
    empty_unused_memory_level: int = option(0, choices=[0, 1, 2])
    """Return the CUDA caching allocator's unused blocks to the GPU (torch.cuda.empty_cache): 1 after each step's
    forward-backward pass and after each evaluation, 2 also after each optimizer step; 0: never. Lowers
    fragmentation, costs new allocations; nothing to do on a CPU."""
    calculate_per_token_loss: bool = False
    """Average the loss, and the gradients, over all unmasked tokens of the global batch (all micro-batches and
    data-parallel ranks) instead of over each micro-batch's tokens and then over the micro-batches (Megatron-LM's
    flag; the two differ when micro-batches hold different numbers of unmasked tokens, e.g. with --eod-mask-loss)."""
    cuda_graph_impl: str = option("none", choices=["none", "transformer_engine"])
    """CUDA graphs. `transformer_engine`: before the first step, capture each transformer layer's forward and
    backward once with Transformer Engine's `make_graphed_callables`, then replay them, so that a layer costs one
    launch each way instead of the hundreds of kernel launches and the Python of its TE modules; FP8 weights are
    still cast once per step. For models whose step waits on the host (small layers, tensor parallelism). Needs
    --transformer-impl transformer_engine, one pipeline stage and fixed shapes (no --reset-position-ids or
    --reset-attention-mask); the captured activations stay allocated. `none`: run eagerly."""
    use_mcore_models: bool = False
    """Accepted and ignored, as in Megatron-LM today: it chose Megatron Core's GPT model over the legacy one, and
    the model here is the Megatron Core design (the only one)."""

    def finalize(self) -> None:
        if isinstance(self.step_batch_size_schedule, list):  # the words argparse collected: one schedule string
            self.step_batch_size_schedule = " ".join(self.step_batch_size_schedule)
        require(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        require(
            self.train_iters is None or self.train_samples is None,
            "--train-iters and --train-samples both given: train by iterations or by samples, drop one",
        )
        if self.train_iters is None and self.train_samples is None:
            self.train_iters = 100
        require(
            self.train_iters is None or self.train_iters >= 0, f"--train-iters must be >= 0, got {self.train_iters}"
        )
        require(self.train_samples is None or self.train_samples >= 0, "--train-samples must be >= 0")
        require(
            self.rampup_batch_size is None or self.step_batch_size_schedule is None,
            "--rampup-batch-size and --step-batch-size-schedule both given: use one batch-size schedule",
        )
        require(self.eval_interval >= 1, f"--eval-interval must be >= 1, got {self.eval_interval}")
        require(self.eval_iters >= 0, f"--eval-iters must be >= 0, got {self.eval_iters}")
        require(self.exit_interval is None or self.exit_interval >= 1, "--exit-interval must be >= 1")
        require(
            self.exit_duration_in_mins is None or self.exit_duration_in_mins >= 0,
            "--exit-duration-in-mins must be >= 0",
        )
        require(
            self.max_consecutive_skipped_iterations >= 1,
            f"--max-consecutive-skipped-iterations must be >= 1, got {self.max_consecutive_skipped_iterations}",
        )
        require(self.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got {self.manual_gc_interval}")


@dataclass
class CheckpointConfig:
    save: str | None = None
    """Directory to save checkpoints to."""
    load: str | None = None
    """Directory to load a checkpoint from (its latest iteration); a directory without one starts from scratch
    (logged), unless --exit-on-missing-checkpoint."""
    exit_on_missing_checkpoint: bool = False
    """With --load: stop with exit status 1 when the directory holds no checkpoint (a mistyped path, a job that
    should resume), instead of starting from scratch (Megatron-LM's flag and exit status)."""
    save_interval: int | None = None
    """Save a checkpoint every this many iterations (and at the end of training) when --save is set."""
    no_load_optim: bool = False
    """Do not load the optimizer and scheduler state from the checkpoint."""
    no_load_rng: bool = False
    """Do not load the random-number-generator states from the checkpoint."""
    finetune: bool = False
    """Load only the model weights and start at iteration 0 (no optimizer, scheduler, RNG or data position)."""
    ckpt_format: str = option("torch_dist", choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"])
    """Checkpoint format to save in. `torch_dist` (the default): torch.distributed.checkpoint (DCP) files holding
    every tensor in global form (each rank writes its chunks at their global offsets), so a checkpoint loads under
    any tensor, pipeline and data-parallel layout, optimizer state (also the distributed optimizer's and the
    precision-aware optimizer's encoded states) and FP8 scaling state included; see docs/checkpoints.md. `torch`:
    torch.save files per tensor x pipeline rank in Megatron-LM's legacy layout
    (iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt), loaded only with the layout that wrote them. Both write a
    checkpoint completely before the latest pointer moves to it. Loading: with torch_dist the format is read from
    the checkpoint (a torch checkpoint loads as such, as in Megatron-LM); with torch a torch_dist checkpoint stops
    with an error unless --auto-detect-ckpt-format is given. torch_dcp and fsdp_dtensor (Megatron-LM's formats for
    its FSDP) stop with an error."""
    trust_checkpoint: bool = False
    """Load checkpoint files the old way, as full pickles that may run code, for files you trust (a checkpoint is
    otherwise data only: this project's files load weights-only, foreign ones through an allowlist, and a file naming
    any other class is refused in one line; docs/checkpoints.md). The same as MEGATRON_TRUST_CHECKPOINT=1."""
    auto_detect_ckpt_format: bool = False
    """Load a checkpoint in the format found on disk (torch or torch_dist, told apart by its files) whatever
    --ckpt-format says; saves still use --ckpt-format. With --ckpt-format torch_dist loading already does this (as in
    Megatron-LM); with --ckpt-format torch it lets a torch_dist checkpoint load (under any parallel layout). The
    log names the format found when it differs from --ckpt-format."""
    async_save: bool = False
    """With --ckpt-format torch_dist: write checkpoints in the background. Training waits only while the state is
    copied to host memory; the write runs in a thread, and the checkpoint becomes visible (renamed, latest pointer
    moved) once it is complete: checked after every step, before the next save and at the end of training."""
    use_persistent_ckpt_worker: bool = False
    """Accepted, already the behaviour: Megatron-LM's flag keeps one worker process for --async-save instead of
    starting a process per save; here the background write is a thread of the training process (DCP's thread
    executor), so no process is started per save either way."""
    dist_ckpt_strictness: str = option(
        "assume_ok_unexpected",
        choices=[
            "assume_ok_unexpected",
            "log_unexpected",
            "log_all",
            "raise_unexpected",
            "raise_all",
            "return_unexpected",
            "return_all",
            "ignore_all",
        ],
    )
    """Loading a torch_dist checkpoint: what to do with weights the checkpoint lacks (missing) or holds and this
    model has no place for (unexpected). assume_ok_unexpected: do not look for unexpected ones; missing ones stop
    with an error (so for log_unexpected, raise_unexpected, return_unexpected); log_unexpected / raise_unexpected:
    log / stop on unexpected ones; log_all / return_all: log both (missing ones keep their current values);
    raise_all: stop on both; ignore_all: ignore both. (return_* log here: the trainer is the caller.) A mis-shaped
    weight always stops with an error."""

    save_retain_last: int | None = None
    """After each successful save, delete all but the newest N checkpoints under --save (default: keep all). The
    one `latest` names is never deleted; keep N >= 2 so that a checkpoint damaged after its save (they are verified
    at load) leaves an older one to fall back to. With --save-retain-interval, its multiples are kept as well."""
    save_retain_interval: int | None = None
    """Megatron-LM's retention rule: after each successful save, delete the older checkpoints under --save whose
    iteration is not a multiple of this (the one `latest` names always stays; a multiple of --save-interval). With
    --save-retain-last N the newest N are kept as well."""
    verify_integrity: bool = False
    """Refuse to load a checkpoint that does not verify, in one line, instead of falling back to an older one; and
    refuse one saved without checksums. (Every torch_dist and torch checkpoint here records each file's size and
    CRC-32 at save and is checked at load anyway: megatron/checkpoint/integrity.py; without this flag a damaged
    latest checkpoint makes the newest older one that verifies load, logged.)"""
    use_checkpoint_opt_param_scheduler: bool = option(False, flag="--use-checkpoint-opt_param-scheduler")
    """Resuming: take the learning-rate schedule (--lr, --min-lr, the warmup, decay and WSD flags, --lr-decay-style,
    --decoupled-lr/--decoupled-min-lr) from the checkpoint and ignore those flags (Megatron-LM's meaning). The
    weight decay is constant here (--weight-decay), not part of a schedule, and always the flag's."""
    override_opt_param_scheduler: bool = option(False, flag="--override-opt_param-scheduler")
    """Resuming: the learning-rate schedule flags win over the checkpoint's values (Megatron-LM's meaning). Without
    either scheduler flag the flags win too, and the settings that differ from the checkpoint's are logged
    (Megatron-LM stops there instead)."""
    ckpt_fully_parallel_save: bool = option(True, action=argparse.BooleanOptionalAction)
    """torch_dist: every rank writes a share of the replicated tensors (weights replicated over data-parallel
    ranks), balanced by size (DCP's deduplication), besides its own shards: Megatron-LM's default.
    --no-ckpt-fully-parallel-save: the lowest rank holding a replicated tensor writes it. The files load the same
    either way under any layout."""
    ckpt_fully_parallel_load: bool = False
    """Accepted, already the behaviour: loading a torch_dist checkpoint, every rank reads only the chunks it holds
    (those overlapping its tensor-parallel slice and its distributed-optimizer piece), all ranks at once; no rank
    reads the whole checkpoint for others."""
    dist_ckpt_optim_fully_reshardable: bool = False
    """Accepted, already the behaviour: torch_dist saves the distributed optimizer's state (main weights, moments)
    in global form, so it loads under any tensor, pipeline and data-parallel layout (docs/checkpoints.md)."""
    ckpt_assume_constant_structure: bool = False
    """Accepted; changes nothing here: under this hint Megatron-LM reuses its save plan between saves and skips its
    sharding checks. Each save here plans afresh (DCP's plan cache is not used), so a save is correct whatever
    changed since the last one."""
    async_strategy: str = option("mcore", choices=["nvrx", "mcore"])
    """--async-save's writer: `mcore`, the one built here (a background thread of the training process through
    DCP's async save). `nvrx` (NVIDIA Resiliency Extension's writer) is refused with --async-save; without
    --async-save the value is unused (Megatron-LM's rule)."""

    def finalize(self) -> None:
        require(self.save_interval is None or self.save_interval >= 1, "--save-interval must be >= 1")
        require(
            self.save_retain_last is None or self.save_retain_last >= 1,
            "--save-retain-last must be >= 1 (the newest checkpoint is always kept; 2 or more leave one to fall back"
            " to)",
        )
        require(self.save_retain_last is None or self.save, "--save-retain-last needs --save DIR")
        require(
            self.save_retain_interval is None or (self.save_retain_interval >= 1 and self.save),
            "--save-retain-interval must be >= 1 and needs --save DIR",
        )
        require(
            self.save_retain_interval is None
            or self.save_interval is None
            or self.save_retain_interval % self.save_interval == 0,
            f"--save-retain-interval {self.save_retain_interval} must be a multiple of --save-interval"
            f" {self.save_interval} (Megatron-LM's rule: otherwise no save would be retained)",
        )
        require(
            not (self.use_checkpoint_opt_param_scheduler and self.override_opt_param_scheduler),
            "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler contradict each other: give one",
        )
        require(
            not (self.async_save and self.async_strategy == "nvrx"),
            "--async-strategy nvrx (NVIDIA Resiliency Extension's writer) is not built here; choices: mcore (the"
            " default, a background thread), or drop --async-save",
        )
        require(self.save_interval is None or self.save, "--save-interval needs --save DIR")
        require(
            not self.exit_on_missing_checkpoint or self.load,
            "--exit-on-missing-checkpoint applies to --load DIR: add --load or drop the flag",
        )
        require(
            self.ckpt_format in ("torch", "torch_dist"),
            f"--ckpt-format {self.ckpt_format}: Megatron-LM's format for its FSDP is not implemented here; use"
            " --ckpt-format torch_dist (loads under any parallel layout) or torch",
        )
        require(
            not self.async_save or self.ckpt_format == "torch_dist",
            "--async-save writes --ckpt-format torch_dist checkpoints: add --ckpt-format torch_dist or drop"
            " --async-save",
        )
        require(
            self.dist_ckpt_strictness == "assume_ok_unexpected"
            or self.ckpt_format == "torch_dist"
            or self.auto_detect_ckpt_format,
            "--dist-ckpt-strictness applies to loading torch_dist checkpoints (a torch checkpoint must match the"
            " model exactly); add --ckpt-format torch_dist or --auto-detect-ckpt-format, or drop the flag",
        )


@dataclass
class LoggingConfig:
    log_interval: int = 10
    """Print a Megatron-format progress line every this many iterations."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars (loss, learning rate, grad norm, throughput) here."""
    log_dir: str | None = None
    """Write the resolved configuration (config.json) here; defaults to --save or --tensorboard-dir."""
    log_throughput: bool = False
    """Accepted for Megatron-LM's scripts: every progress line shows the throughput already (TFLOP/s per GPU,
    tokens/s, MFU). With --log-timers-to-tensorboard it is also written as the `throughput` scalar."""
    log_params_norm: bool = False
    """Add the L2 norm of the parameters (their fp32 main copies, each element of the model counted once over
    all tensor, pipeline and data-parallel shards) to the progress line and TensorBoard (`params-norm`)."""
    log_num_zeros_in_grad: bool = False
    """Count the zero elements of the gradients the optimizer steps on (each counted once over all ranks) and
    add them to the progress line and TensorBoard (`num-zeros`); one extra reduction per step."""
    log_memory_to_tensorboard: bool = False
    """Write the CUDA allocator's memory statistics to TensorBoard at each log interval: mem-reserved-bytes,
    mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count (none on a CPU)."""
    log_validation_ppl_to_tensorboard: bool = False
    """Also write the validation perplexity to TensorBoard (`lm loss validation ppl`); the loss is always written
    and both are always printed."""
    timing_log_level: int = option(0, choices=[0, 1, 2])
    """Step phases to time and print below the progress line (megatron/training/timers.py). 0: only the
    iteration time, no extra synchronization; 1: phases run once per step (forward-backward, gradient all-reduces,
    optimizer); 2: also per micro-batch (forward-compute, backward-compute). On a GPU a timed phase synchronizes
    the device at its start and end, so levels 1 and 2 slow the step down."""
    timing_log_option: str = option("minmax", choices=["max", "minmax", "all"])
    """How the timers of --timing-log-level are reported over ranks: max, (min, max), or every rank."""
    log_timers_to_tensorboard: bool = False
    """Write the timers of --timing-log-level to TensorBoard (`<name>-time`, the maximum over ranks in ms per
    iteration), and the `throughput` scalar with --log-throughput."""
    profile: bool = False
    """Profile the steps from --profile-step-start to --profile-step-end with Nsight Systems: cudaProfilerStart
    and Stop around them and NVTX ranges for each step and its phases, only inside that window. Run under `nsys
    profile -s none -t nvtx,cuda --capture-range=cudaProfilerApi --capture-range-end=stop ...`. On a CPU there
    is nothing for nsys to capture: use --use-pytorch-profiler there."""
    profile_step_start: int = 10
    """--profile: the window starts once this many steps are done (iteration start+1 is its first)."""
    profile_step_end: int = 12
    """--profile: the window ends after this iteration."""
    profile_ranks: list[int] = option([], nargs="+")
    """--profile: the global ranks that profile (default: all)."""
    use_pytorch_profiler: bool = False
    """With --profile: record a torch.profiler trace of the window instead (CPU ops and CUDA kernels, with the
    same step and phase ranges), written to --tensorboard-dir as rank<R>.*.pt.trace.json for TensorBoard's profiler
    plugin or Perfetto."""

    def finalize(self) -> None:
        require(self.log_interval >= 1, f"--log-interval must be >= 1, got {self.log_interval}")
        require(
            not self.use_pytorch_profiler or self.profile,
            "--use-pytorch-profiler selects the profiler of --profile: add --profile",
        )
        require(
            not self.profile or 0 <= self.profile_step_start < self.profile_step_end,
            f"--profile needs 0 <= --profile-step-start < --profile-step-end, got {self.profile_step_start} and"
            f" {self.profile_step_end}",
        )
        require(
            not self.use_pytorch_profiler or self.tensorboard_dir,
            "--use-pytorch-profiler writes its trace to --tensorboard-dir: add --tensorboard-dir DIR",
        )
