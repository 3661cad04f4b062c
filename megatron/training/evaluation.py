"""Evaluation of a split: which samples it reads, its loss over the data-parallel ranks, and its line.

As in Megatron-LM, validation reads on from `TrainState.consumed_valid_samples` (each evaluation the next samples, a
resumed run where the checkpoint stopped), or with --full-validation the whole split from its start; the test split
is read from its start.
"""

from __future__ import annotations

from torch.utils.data import Dataset

from megatron.config import TrainingConfig

from .data_loading import Loaders
from .logger import print_rank_0
from .progress import Progress
from .runtime import Runtime
from .steps import Steps
from .train_state import TrainState


class Evaluation:
    """`run(dataset)`: the loss over --eval-iters global batches of `dataset` (every rank calls it)."""

    def __init__(
        self,
        train: TrainingConfig,
        num_micro_batches: int,
        state: TrainState,
        loader: Loaders,
        steps: Steps,
        runtime: Runtime,
        progress: Progress,
    ):
        self.train, self.num_micro_batches, self.state = train, num_micro_batches, state
        self.loader, self.steps, self.runtime, self.progress = loader, steps, runtime, progress

    def run(self, dataset: Dataset | None, split: str = "validation", final: bool = False) -> float | None:
        """The loss of `dataset`'s next evaluation (None without the split or with --eval-iters 0), logged; `final`:
        the evaluation after training (its own log line)."""
        train, state = self.train, self.state
        if dataset is None or train.eval_iters == 0:
            return None
        full = split == "validation" and train.full_validation
        iters = len(dataset) // train.global_batch_size if full else train.eval_iters
        samples = iters * train.global_batch_size
        start = state.consumed_valid_samples if split == "validation" and not full else 0
        if start + samples > len(dataset):  # more evaluations than the split was sized for (flags changed)
            print_rank_0(f"> the {split} samples from {start} on are fewer than {samples}: reading from sample 0")
            start = 0
        self.runtime.before_evaluation()
        batches = iter(self.loader(dataset, start))
        loss = self.steps.evaluation_loss(batches, iters * self.num_micro_batches)
        if split == "validation" and not full:
            state.consumed_valid_samples += samples
        self.runtime.after_evaluation()
        self.progress.log_validation(state.iteration, loss, split, final)
        return loss
