"""Runs that go wrong: a diverged run stops instead of skipping steps forever (--check-for-nan-in-loss-and-grad,
--max-consecutive-skipped-iterations), a loss spike is logged with its iteration, and a collective that fails
because another rank died becomes one line instead of a traceback (or a hang).

Every check reads only values every rank already shares after a step (the loss averaged over the data-parallel and
pipeline ranks, the global gradient norm, whether the step was applied), so every rank decides the same without a
collective of its own.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from megatron.config import Config
from megatron.errors import DivergenceError, LostRankError
from megatron.optim.loss_scaler import DynamicLossScaler, LossScaler

from .logger import TensorBoardWriter, print_rank_0


def non_finite_step(loss: float, norm: float, stepped: bool, fp16: bool) -> bool:
    """A step skipped because the loss or the gradient norm is not finite. fp16's overflow steps are the loss
    scaler's business (as in Megatron-LM): only a non-finite loss counts there."""
    return not stepped and (not math.isfinite(loss) or (not math.isfinite(norm) and not fp16))


class NonFiniteGuard:
    """Counts skipped non-finite steps in a row and stops the run after `limit` of them."""

    def __init__(self, enabled: bool, limit: int, fp16: bool, loss_scaler: LossScaler):
        self.enabled, self.limit, self.fp16, self.loss_scaler = enabled, limit, fp16, loss_scaler
        self.in_a_row = 0

    def _at_min_scale(self) -> bool:
        scaler = self.loss_scaler
        return not isinstance(scaler, DynamicLossScaler) or scaler.scale <= scaler.min_scale

    def after_step(self, iteration: int, loss: float, norm: float, stepped: bool) -> bool:
        """Whether the step was a nan iteration (the log line's count); raises DivergenceError at the limit. Call it
        after the loss scaler's update (its back-off to the minimum scale counts)."""
        nan = non_finite_step(loss, norm, stepped, self.fp16)
        # fp16: overflowing gradients at the smallest loss scale are no longer a scale that is too large
        diverging = nan or (not stepped and self.fp16 and not math.isfinite(norm) and self._at_min_scale())
        self.in_a_row = self.in_a_row + 1 if diverging else 0
        if self.enabled and self.in_a_row >= self.limit:
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            raise DivergenceError(
                f"the run diverged: {self.in_a_row} steps in a row skipped for a non-finite {what} (iteration"
                f" {iteration}, loss {loss}, grad norm {norm}; --max-consecutive-skipped-iterations {self.limit});"
                " nothing saved: resume from the last checkpoint with a lower --lr, a longer warm-up or --clip-grad,"
                " or add --no-check-for-nan-in-loss-and-grad to train on"
            )
        return nan


class SpikeDetector:
    """A loss spike: a finite loss above both mean + `k` standard deviations and (1 + `rel`) x the mean of the
    previous `window` finite losses (once `min_history` of them exist). The relative margin keeps a flat loss curve,
    whose standard deviation is tiny, from reporting noise."""

    def __init__(self, window: int = 50, k: float = 5.0, rel: float = 0.1, min_history: int = 10):
        self.k, self.rel, self.min_history = k, rel, min_history
        self.history: deque[float] = deque(maxlen=window)
        self.count = 0

    def after_step(self, iteration: int, loss: float, tensorboard: TensorBoardWriter | None = None) -> bool:
        if not math.isfinite(loss):
            return False
        spike = False
        if len(self.history) >= self.min_history:
            mean = sum(self.history) / len(self.history)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / len(self.history))
            if loss > mean + self.k * std and loss > (1 + self.rel) * mean:
                spike = True
                self.count += 1
                print_rank_0(
                    f"> loss spike at iteration {iteration}: lm loss {loss:.6E}, mean {mean:.6E} (std {std:.3E}) over"
                    f" the previous {len(self.history)} steps; {self.count} spike(s) so far"
                )
                if tensorboard is not None:
                    tensorboard.scalars({"loss-spikes": self.count}, iteration)
        # A spike enters the window too: a lasting jump becomes the new normal instead of a spike at every step
        self.history.append(loss)
        return spike


PEER_FAILURE_HINTS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "socket closed",
    "timed out",
    "timeout",
    "watchdog",
    "nccl communicator was aborted",
    "remote process exited",
)
"""Words of the errors that gloo, NCCL and the c10d store raise when a peer died or stopped answering."""


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective or store failure caused by another rank (not a bug of this one)."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):  # NCCL's errors and timeouts, the store's
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(hint in text for hint in PEER_FAILURE_HINTS)


def lost_rank_error(exc: BaseException, timeout_minutes: int) -> LostRankError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    rank = dist.get_rank() if dist.is_initialized() else 0
    return LostRankError(
        f"rank {rank}: a collective failed, most likely because another rank died or stopped answering (killed,"
        f" out of memory, a lost node; collectives wait at most --distributed-timeout-minutes {timeout_minutes}):"
        f" see the first failing rank's log; resume from the last checkpoint with --load. ({first[:200]})"
    )


T = TypeVar("T")


def guard_collectives(fn: Callable[[], T], timeout_minutes: int) -> T:
    """Run `fn`, turning a failure caused by another rank into a LostRankError (one line, non-zero exit)."""
    try:
        return fn()
    except Exception as exc:
        if is_peer_failure(exc):
            raise lost_rank_error(exc, timeout_minutes) from exc
        raise


class RunGuards:
    """What the trainer calls after each step: the divergence stop and the spike log."""

    def __init__(self, cfg: Config, loss_scaler: LossScaler, tensorboard: TensorBoardWriter | None = None):
        train = cfg.training
        fp16 = cfg.precision.fp16
        limit = train.max_consecutive_skipped_iterations
        self.non_finite = NonFiniteGuard(train.check_for_nan_in_loss_and_grad, limit, fp16, loss_scaler)
        self.spikes = SpikeDetector()
        self.tensorboard = tensorboard

    def after_step(self, iteration: int, loss: float, norm: float, stepped: bool) -> bool:
        """Whether the step was a nan iteration; raises DivergenceError when the run diverged."""
        self.spikes.after_step(iteration, loss, self.tensorboard)
        return self.non_finite.after_step(iteration, loss, norm, stepped)
