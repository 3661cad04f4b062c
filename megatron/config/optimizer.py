"""Optimizer, learning-rate schedule and gradient clipping."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import ConfigError, option, require

O2_STATES = {
    "exp_avg_dtype": "fp8",
    "exp_avg_sq_dtype": "fp16",
    "main_params_dtype": "fp16",
    "main_grads_dtype": "bf16",
}
"""What --fp8-optimizer-level O2 sets: MS-AMP's O2 states, and bf16 gradient buffers (MS-AMP keeps weight gradients
in FP8 from O1 on). The bf16 buffers take 2 bytes per parameter off (6.2 instead of 8.2 at DP=2 on llama-1b) at the
speed of fp32 ones. With FP8 weights on llama-150m, O2 ends +0.005% (95% interval -0.006 .. +0.016%, three seeds)
from fp32 states and gradient buffers (docs/loss_parity.md). fp32 buffers: spell the states out with
--use-precision-aware-optimizer and --fp8-grad-reduce instead of the level."""


@dataclass
class OptimizerConfig:
    optimizer: str = option("adam", choices=["adam"])
    """Optimizer: AdamW (decoupled weight decay, as Megatron-LM's `adam`)."""
    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 0.0
    """Learning rate at the end of decay (and after it)."""
    lr_decay_style: str = option("cosine", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    """Shape of the decay from --lr to --min-lr after warmup (megatron/optim/schedule.py). WSD (warmup-stable-
    decay) holds --lr until the last --lr-wsd-decay-iters (or -samples) of the decay span, then anneals to
    --min-lr with --lr-wsd-decay-style."""
    lr_wsd_decay_style: str = option("exponential", choices=["exponential", "linear", "cosine", "minus_sqrt"])
    """With --lr-decay-style WSD: the shape of the annealing phase."""
    lr_warmup_iters: int = 0
    """Iterations of linear warmup from --lr-warmup-init to --lr (iteration-based training)."""
    lr_warmup_samples: int = 0
    """Samples of linear warmup from --lr-warmup-init to --lr (with --train-samples)."""
    lr_warmup_fraction: float | None = None
    """Warm up over this fraction of the decay span (--lr-decay-iters or --lr-decay-samples), instead of
    --lr-warmup-iters / --lr-warmup-samples."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of warmup."""
    lr_decay_iters: int | None = None
    """Iteration at which decay ends; defaults to --train-iters."""
    lr_decay_samples: int | None = None
    """Consumed samples at which decay ends (with --train-samples); defaults to --train-samples."""
    lr_wsd_decay_iters: int | None = None
    """With --lr-decay-style WSD: iterations of annealing at the end of the decay span (iteration-based)."""
    lr_wsd_decay_samples: int | None = None
    """With --lr-decay-style WSD: samples of annealing at the end of the decay span (with --train-samples)."""
    decoupled_lr: float | None = None
    """Peak learning rate of the input embedding (word embeddings) and output layer weights, on the same schedule
    shape as --lr; the other parameters keep --lr. With tied embeddings the shared weight takes it."""
    decoupled_min_lr: float | None = None
    """With --decoupled-lr: the embedding and output layer's learning rate at the end of decay (default
    --min-lr)."""
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
    use_precision_aware_optimizer: bool = False
    """Keep the main (master) parameters and Adam's moments in the precisions that --main-params-dtype,
    --exp-avg-dtype and --exp-avg-sq-dtype choose (Megatron-LM's precision-aware optimizer; FP8-LM / MS-AMP's
    low-precision states). Each step decodes one tensor at a time, updates it in fp32 and encodes it back
    (megatron/optim/states.py)."""
    main_params_dtype: str = option("fp32", choices=["fp32", "fp16"])
    """With --use-precision-aware-optimizer: the main parameters' storage; fp16 carries per-block scales and a
    rounding remainder, so that updates far below an fp16 ulp still add up (FP8-LM's precision decoupling)."""
    main_grads_dtype: str = option("fp32", choices=["fp32", "bf16"])
    """With --use-precision-aware-optimizer: the gradients the optimizer reads; bf16 keeps the gradient buffers in
    bf16 (accumulation and data-parallel reduction too, as --grad-reduce-in-bf16) and reads them without an fp32
    copy."""
    exp_avg_dtype: str = option("fp32", choices=["fp32", "fp16", "bf16", "fp8"])
    """With --use-precision-aware-optimizer: Adam's first moment; fp8 is e4m3 with per-block scales."""
    exp_avg_sq_dtype: str = option("fp32", choices=["fp32", "fp16", "bf16", "fp8"])
    """With --use-precision-aware-optimizer: Adam's second moment; fp16 and fp8 carry per-block scales."""
    fp8_optimizer_level: str | None = option(None, choices=["O1", "O2"])
    """MS-AMP's optimization levels as shorthand: O1 = --fp8-grad-reduce (FP8 gradient communication, fp32
    states); O2 = O1 + --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16
    --main-params-dtype fp16 --main-grads-dtype bf16. Flags that contradict the level are an error."""

    def finalize(self) -> None:
        require(self.lr >= 0, f"--lr must be >= 0, got {self.lr}")
        require(0 <= self.min_lr <= self.lr, f"--min-lr ({self.min_lr}) must be in [0, --lr ({self.lr})]")
        require(self.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0")
        require(self.lr_decay_iters is None or self.lr_decay_iters >= 1, "--lr-decay-iters must be >= 1")
        require(self.lr_decay_samples is None or self.lr_decay_samples >= 1, "--lr-decay-samples must be >= 1")
        require(self.lr_warmup_samples >= 0, "--lr-warmup-samples must be >= 0")
        require(
            self.lr_warmup_fraction is None or 0 <= self.lr_warmup_fraction <= 1,
            f"--lr-warmup-fraction must be in [0, 1], got {self.lr_warmup_fraction}",
        )
        for flag, value in (
            ("--lr-warmup-iters", self.lr_warmup_iters),
            ("--lr-warmup-samples", self.lr_warmup_samples),
        ):
            require(
                self.lr_warmup_fraction is None or value == 0,
                f"--lr-warmup-fraction and {flag} both given: warm up by one of the two",
            )
        require(
            0 <= self.lr_warmup_init <= self.lr,
            f"--lr-warmup-init ({self.lr_warmup_init}) must be in [0, --lr ({self.lr})]",
        )
        for flag, value in (
            ("--lr-wsd-decay-iters", self.lr_wsd_decay_iters),
            ("--lr-wsd-decay-samples", self.lr_wsd_decay_samples),
        ):
            require(value is None or value >= 1, f"{flag} must be >= 1")
        require(
            self.decoupled_min_lr is None or self.decoupled_lr is not None,
            "--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's peak learning rate)",
        )
        if self.decoupled_lr is not None:
            low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            require(
                0 <= low <= self.decoupled_lr,
                f"--decoupled-min-lr (or --min-lr) ({low}) must be in [0, --decoupled-lr ({self.decoupled_lr})]",
            )
        require(self.weight_decay >= 0, "--weight-decay must be >= 0")
        require(0 <= self.adam_beta1 < 1, f"--adam-beta1 must be in [0, 1), got {self.adam_beta1}")
        require(0 <= self.adam_beta2 < 1, f"--adam-beta2 must be in [0, 1), got {self.adam_beta2}")
        require(self.adam_eps > 0, "--adam-eps must be > 0")
        require(self.clip_grad >= 0, "--clip-grad must be >= 0")
        if self.fp8_optimizer_level == "O2":
            for name, value in O2_STATES.items():
                default = type(self).__dataclass_fields__[name].default
                require(
                    getattr(self, name) in (default, value),
                    f"--fp8-optimizer-level O2 sets --{name.replace('_', '-')} {value}; drop one of the two",
                )
                setattr(self, name, value)
            self.use_precision_aware_optimizer = True
        if not self.use_precision_aware_optimizer:
            for name in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
                require(
                    getattr(self, name) == "fp32",
                    f"--{name.replace('_', '-')} {getattr(self, name)} needs --use-precision-aware-optimizer",
                )


SCHEDULE_FIELDS = (
    "lr",
    "min_lr",
    "lr_decay_style",
    "lr_wsd_decay_style",
    "lr_warmup_iters",
    "lr_warmup_samples",
    "lr_warmup_fraction",
    "lr_warmup_init",
    "lr_decay_iters",
    "lr_decay_samples",
    "lr_wsd_decay_iters",
    "lr_wsd_decay_samples",
)
"""The learning-rate schedule's settings (Megatron-LM's OptimizerParamScheduler state): what
--use-checkpoint-opt_param-scheduler takes from a checkpoint and --override-opt_param-scheduler lets the flags
replace. Finalized values are compared (--lr-decay-iters defaults to --train-iters, so it counts)."""


def schedule_differences(flags: OptimizerConfig, saved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (flag value, checkpoint value)} for the schedule settings a checkpoint's optimizer section (its
    saved config) holds with another value; ConfigError (one line) for a value that is not a number, a name or
    None."""
    differ = {}
    for name in SCHEDULE_FIELDS:
        if name not in saved:
            continue
        value = saved[name]
        if not (value is None or type(value) in (int, float, str)):
            raise ConfigError(f"the checkpoint's {name} is {str(value)[:40]!r}, not a schedule setting")
        if value != getattr(flags, name):
            differ[name] = (getattr(flags, name), value)
    return differ


def resolve_schedule(
    flags: OptimizerConfig, saved: Mapping[str, Any], use_checkpoint: bool
) -> tuple[OptimizerConfig, dict[str, tuple[Any, Any]]]:
    """The optimizer settings a resumed run uses and the schedule settings in which flags and checkpoint differ:
    with `use_checkpoint` (--use-checkpoint-opt_param-scheduler) the checkpoint's schedule replaces the flags';
    otherwise the flags' stand."""
    differ = schedule_differences(flags, saved)
    if use_checkpoint and differ:
        flags = dataclasses.replace(flags, **{name: saved_value for name, (_, saved_value) in differ.items()})
    return flags, differ
