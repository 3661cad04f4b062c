"""The global batch size of every step: constant, ramped up (--rampup-batch-size) or step-wise
(--step-batch-size-schedule), and what follows from it (micro-batches per step, run length in steps and samples).

A schedule is a list of phases (first consumed sample, global batch size), the first starting at 0: a step taken
after `consumed` samples uses the batch size of the last phase that starts at or before `consumed`. So the batch
size depends only on the consumed samples, and a resumed run continues the ramp from its checkpoint's count.

    constant:                 [(0, G)]
    --rampup-batch-size S I N: K = (G - S) / I increments; phase k (k = 0..K) starts at ceil(k * N / K) samples with
                              batch S + k * I (Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator)
    --step-batch-size-schedule "T0:B0 T1:B1 ...": phase i starts at Ti // seq_length samples (Ti counts tokens,
                              suffixes K/M/B/T = 1e3/1e6/1e9/1e12) with batch Bi
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Protocol

from .base import ConfigError
from .model import ModelConfig
from .training import TrainingConfig


class RunConfig(Protocol):
    """What a batch schedule reads of the run's configuration: megatron.config.Config, which validates its
    schedule through this module (and so cannot be imported here)."""

    training: TrainingConfig
    model: ModelConfig

    @property
    def data_parallel_size(self) -> int: ...


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """'2.4B' -> 2400000000 (as Megatron-LM: int(float(number) * suffix))."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _SUFFIXES else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ConfigError(f"--step-batch-size-schedule: {text!r} is not a number (suffixes K, M, B, T)") from None


def parse_step_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """'0:16 2.4B:320' -> [(0, 16), (2.4e9 // seq_length, 320)]: phases in samples, sorted, validated."""
    phases = []
    for entry in text.replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        if not sep:
            raise ConfigError(f"--step-batch-size-schedule: entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        phases.append((parse_count(threshold) // seq_length, parse_count(batch)))
    phases.sort()
    if not phases or phases[0][0] != 0:
        raise ConfigError("--step-batch-size-schedule: the first threshold must be 0 (the batch size at the start)")
    for (a, _), (b, _) in zip(phases, phases[1:]):
        if a == b:
            raise ConfigError(
                f"--step-batch-size-schedule: two entries start at sample {a} (thresholds are tokens divided by"
                f" --seq-length {seq_length}); make the thresholds strictly increasing"
            )
    if any(batch < 1 for _, batch in phases):
        raise ConfigError("--step-batch-size-schedule: every batch size must be >= 1")
    return phases


def rampup_phases(start: int, increment: int, samples: int, final: int) -> list[tuple[int, int]]:
    """--rampup-batch-size START INCREMENT SAMPLES towards the global batch size `final`."""
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if start < 1 or increment < 1 or samples < 0:
        raise ConfigError(f"{flag}: the start and increment must be >= 1 and the ramp-up samples >= 0")
    if start > final or (final - start) % increment:
        raise ConfigError(
            f"{flag}: --global-batch-size ({final}) minus the start ({start}) must be a non-negative multiple of the"
            " increment"
        )
    increments = (final - start) // increment
    if increments == 0:
        return [(0, final)]
    # phase k starts at the first sample count c with c / (samples / increments) >= k, in exact integers
    return [(-(-k * samples // increments), start + k * increment) for k in range(increments + 1)]


@dataclass(frozen=True)
class BatchSchedule:
    phases: tuple[tuple[int, int], ...]
    """(first consumed sample, global batch size), sorted by the first."""
    micro_batch_size: int
    data_parallel_size: int

    @classmethod
    def from_config(cls, cfg: RunConfig) -> BatchSchedule:
        """The run's schedule. Needs --global-batch-size resolved (Config.finalize does that)."""
        train = cfg.training
        assert train.global_batch_size is not None, "finalize the configuration first"
        if train.step_batch_size_schedule is not None:
            phases = parse_step_schedule(train.step_batch_size_schedule, cfg.model.seq_length)
        elif train.rampup_batch_size is not None:
            phases = rampup_phases(*train.rampup_batch_size, train.global_batch_size)
        else:
            phases = [(0, train.global_batch_size)]
        return cls(tuple(phases), train.micro_batch_size, cfg.data_parallel_size)

    @property
    def final_batch_size(self) -> int:
        return self.phases[-1][1]

    @property
    def is_constant(self) -> bool:
        return len({batch for _, batch in self.phases}) == 1

    def _phase(self, consumed_samples: int) -> int:
        return bisect.bisect_right(self.phases, (consumed_samples, float("inf"))) - 1

    def global_batch_size(self, consumed_samples: int) -> int:
        """The global batch size of the step taken after `consumed_samples` samples."""
        return self.phases[self._phase(consumed_samples)][1]

    def num_micro_batches(self, consumed_samples: int) -> int:
        """Micro-batches per data-parallel rank of that step; a batch size that the micro-batch size x
        data-parallel size does not divide is a ConfigError (checked when the step comes, as Megatron-LM)."""
        batch = self.global_batch_size(consumed_samples)
        per_step = self.micro_batch_size * self.data_parallel_size
        if batch % per_step:
            raise ConfigError(
                f"global batch size {batch} (batch-size schedule at {consumed_samples} consumed samples) is not a"
                f" multiple of --micro-batch-size ({self.micro_batch_size}) x data-parallel size"
                f" ({self.data_parallel_size}); change the schedule or the parallel layout"
            )
        return batch // per_step

    def _advance(self, consumed: int, iterations: int | None, target: int | None) -> tuple[int, int]:
        """Take steps from `consumed` samples until `iterations` steps are taken or `target` samples reached
        (whichever given comes first), a phase at a time; returns (consumed samples, steps taken)."""
        taken = 0
        while (iterations is None or taken < iterations) and (target is None or consumed < target):
            i = self._phase(consumed)
            batch = self.phases[i][1]
            limit = min(
                self.phases[i + 1][0] if i + 1 < len(self.phases) else math.inf,
                math.inf if target is None else target,
            )
            steps = -(-(limit - consumed) // batch) if limit != math.inf else math.inf
            if iterations is not None:
                steps = min(steps, iterations - taken)
            consumed, taken = consumed + int(steps) * batch, taken + int(steps)
        return consumed, taken

    def samples_after(self, iterations: int, consumed_samples: int = 0) -> int:
        """Consumed samples after `iterations` steps from `consumed_samples`."""
        return self._advance(consumed_samples, iterations, None)[0]

    def iterations_for(self, train_samples: int) -> int:
        """Steps a --train-samples run takes: with a constant batch size the whole batches that fit (a last partial
        batch is dropped); with a schedule, steps until the consumed samples reach `train_samples` (Megatron-LM's
        two rules)."""
        if self.is_constant:
            return train_samples // self.final_batch_size
        return self._advance(0, None, train_samples)[1]

    def check_from(self, consumed_samples: int, iterations: int) -> None:
        """Check every batch size the next `iterations` steps will use, so that a schedule that does not fit the
        parallel layout fails at start rather than hours in."""
        end = self.samples_after(iterations, consumed_samples)
        while consumed_samples < end:
            self.num_micro_batches(consumed_samples)
            i = self._phase(consumed_samples)
            if i + 1 == len(self.phases):
                break
            consumed_samples = self._advance(consumed_samples, None, min(self.phases[i + 1][0], end))[0]


def train_iterations(cfg: RunConfig) -> int:
    """Steps the whole run takes: --train-iters, or the steps --train-samples makes with the batch schedule."""
    train = cfg.training
    if train.train_iters is not None:
        return train.train_iters
    assert train.train_samples is not None
    return BatchSchedule.from_config(cfg).iterations_for(train.train_samples)


def train_samples(cfg: RunConfig) -> int:
    """Samples the whole run consumes (what the training data set must hold)."""
    return BatchSchedule.from_config(cfg).samples_after(train_iterations(cfg))
