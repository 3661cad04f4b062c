"""Optimizer, learning-rate schedule and gradient clipping."""

from __future__ import annotations

from dataclasses import dataclass

from .base import option, require


@dataclass
class OptimizerConfig:
    optimizer: str = option("adam", choices=["adam"])
    """Optimizer: AdamW (decoupled weight decay, as Megatron-LM's `adam`)."""
    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 0.0
    """Learning rate at the end of decay (and after it)."""
    lr_decay_style: str = option("cosine", choices=["constant", "linear", "cosine"])
    """Shape of the decay from --lr to --min-lr after warmup."""
    lr_warmup_iters: int = 0
    """Iterations of linear warmup from 0 to --lr."""
    lr_decay_iters: int | None = None
    """Iteration at which decay ends; defaults to --train-iters."""
    weight_decay: float = 0.01
    """Decoupled weight decay, applied to weight matrices and embeddings (not to biases and norms)."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 turns clipping off."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer over the data-parallel ranks (Megatron-LM's distributed optimizer, ZeRO-1): each rank
    keeps the fp32 main parameters and Adam moments of 1/dp of every gradient bucket and updates only those;
    gradients are reduce-scattered instead of all-reduced and the updated parameters all-gathered. Checkpoints then
    hold one optimizer file per data-parallel rank."""

    def finalize(self) -> None:
        require(self.lr >= 0, f"--lr must be >= 0, got {self.lr}")
        require(0 <= self.min_lr <= self.lr, f"--min-lr ({self.min_lr}) must be in [0, --lr ({self.lr})]")
        require(self.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0")
        require(self.lr_decay_iters is None or self.lr_decay_iters >= 1, "--lr-decay-iters must be >= 1")
        require(self.weight_decay >= 0, "--weight-decay must be >= 0")
        require(0 <= self.adam_beta1 < 1, f"--adam-beta1 must be in [0, 1), got {self.adam_beta1}")
        require(0 <= self.adam_beta2 < 1, f"--adam-beta2 must be in [0, 1), got {self.adam_beta2}")
        require(self.adam_eps > 0, "--adam-eps must be > 0")
        require(self.clip_grad >= 0, "--clip-grad must be >= 0")
