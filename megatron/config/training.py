"""Training schedule, checkpointing and logging."""

from __future__ import annotations

from dataclasses import dataclass

from .base import option, require


@dataclass
class TrainingConfig:
    micro_batch_size: int = 4
    """Samples per forward/backward pass on one data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks (gradient accumulation makes up the difference);
    defaults to micro-batch size x data-parallel size."""
    train_iters: int = 100
    """Number of optimizer steps to train for."""
    eval_interval: int = 1000
    """Run validation every this many iterations (and at the end)."""
    eval_iters: int = 10
    """Validation batches (of global-batch size) per validation run; 0 turns validation off."""
    seed: int = 1234
    """Random seed for initialization, dropout and data order."""
    exit_interval: int | None = None
    """Stop (after saving a checkpoint when --save is set) at the first iteration divisible by this value; the
    learning-rate schedule still follows --train-iters, so a later --load continues the same run."""
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

    def finalize(self) -> None:
        require(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        require(self.train_iters >= 0, f"--train-iters must be >= 0, got {self.train_iters}")
        require(self.eval_interval >= 1, f"--eval-interval must be >= 1, got {self.eval_interval}")
        require(self.eval_iters >= 0, f"--eval-iters must be >= 0, got {self.eval_iters}")
        require(self.exit_interval is None or self.exit_interval >= 1, "--exit-interval must be >= 1")


@dataclass
class CheckpointConfig:
    save: str | None = None
    """Directory to save checkpoints to."""
    load: str | None = None
    """Directory to load a checkpoint from (its latest iteration); a directory without one starts from scratch."""
    save_interval: int | None = None
    """Save a checkpoint every this many iterations (and at the end of training) when --save is set."""
    no_load_optim: bool = False
    """Do not load the optimizer and scheduler state from the checkpoint."""
    no_load_rng: bool = False
    """Do not load the random-number-generator states from the checkpoint."""
    finetune: bool = False
    """Load only the model weights and start at iteration 0 (no optimizer, scheduler, RNG or data position)."""

    def finalize(self) -> None:
        require(self.save_interval is None or self.save_interval >= 1, "--save-interval must be >= 1")
        require(self.save_interval is None or self.save, "--save-interval needs --save DIR")


@dataclass
class LoggingConfig:
    log_interval: int = 10
    """Print a Megatron-format progress line every this many iterations."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars (loss, learning rate, grad norm, throughput) here."""
    log_dir: str | None = None
    """Write the resolved configuration (config.json) here; defaults to --save or --tensorboard-dir."""

    def finalize(self) -> None:
        require(self.log_interval >= 1, f"--log-interval must be >= 1, got {self.log_interval}")
