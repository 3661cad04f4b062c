"""How one optimizer step's loss is averaged over its micro-batches (and the gradients with it).

Default (Megatron-LM's): each micro-batch's loss is the mean over its unmasked tokens, and the step's loss the mean
of those over the micro-batches and data-parallel ranks, so a token of a micro-batch with few unmasked tokens weighs
more than one of a full micro-batch.

--calculate-per-token-loss: the step's loss is the mean over all unmasked tokens of the global batch. Backward runs
on each micro-batch's *sum* of token losses; the data-parallel average of the gradients is then multiplied by
dp / (unmasked tokens of the global batch), which turns it into that mean (one all-reduce of the token count over
the data-parallel group; every pipeline stage counts the tokens of its own copy of the batch).

Context parallelism (cp ranks each hold part of every sample's tokens): a micro-batch's mean is over the unmasked
tokens of all cp ranks, as in one process: each rank divides its own token losses' sum by that count (one
all-reduce over the cp group) and multiplies by cp, because gradients and losses are then averaged over the
dp x cp group (Megatron-LM's loss function does the same). The data-parallel group of the functions below is
that dp x cp group (ParallelDims.dp_cp_group); per-token counting needs nothing more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def masked_mean(
    token_losses: torch.Tensor, mask: torch.Tensor, cp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The micro-batch's mean loss over its unmasked tokens; under context parallelism this rank's share of it
    times cp (see the module docstring; averaged over the cp ranks it is the mean)."""
    total, tokens = (token_losses * mask).sum(), mask.sum().float()
    if cp_group is None:
        return total / tokens.clamp(min=1.0)
    tokens = tokens.clone()
    dist.all_reduce(tokens, group=cp_group)
    return total * dist.get_world_size(cp_group) / tokens.clamp(min=1.0)


class StepLoss:
    def __init__(
        self, per_token: bool, num_micro: int, device: torch.device, cp_group: dist.ProcessGroup | None = None
    ):
        self.per_token, self.num_micro, self.cp_group = per_token, num_micro, cp_group
        self.loss = torch.zeros((), device=device)
        """Sum of token losses (per token), or of micro-batch means (default); only the last stage sees losses."""
        self.tokens = torch.zeros((), device=device)
        self._global_tokens: torch.Tensor | None = None

    def add(self, token_losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Record a micro-batch's per-token losses; returns what its backward runs on (before loss scaling)."""
        if self.per_token:
            self.count(mask)
            total = (token_losses * mask).sum()
            self.loss += total.detach().float()
            return total
        mean = masked_mean(token_losses, mask, self.cp_group)
        self.loss += mean.detach().float()
        return mean / self.num_micro

    def count(self, mask: torch.Tensor) -> None:
        """Count a micro-batch's unmasked tokens for --calculate-per-token-loss (pipeline stages without the loss
        call this alone); the default averaging needs no count (a kernel per micro-batch saved)."""
        if self.per_token:
            self.tokens += mask.sum().float()

    def grad_factor(self, dp_group: dist.ProcessGroup | None) -> torch.Tensor | float:
        """What the data-parallel-averaged gradients are multiplied by (a device tensor: no host sync)."""
        if not self.per_token:
            return 1.0
        dp = 1 if dp_group is None else dist.get_world_size(dp_group)
        return dp / self._tokens_over_dp(dp_group).clamp(min=1.0)

    def _tokens_over_dp(self, dp_group: dist.ProcessGroup | None) -> torch.Tensor:
        if self._global_tokens is None:
            self._global_tokens = self.tokens.clone()
            if dp_group is not None:
                dist.all_reduce(self._global_tokens, group=dp_group)
        return self._global_tokens

    def value(self, pp_group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None) -> float:
        """The step's loss, the same on every rank (waits for the device)."""
        loss = self.loss if self.per_token else self.loss / self.num_micro
        if pp_group is not None:
            loss = loss.clone()
            dist.all_reduce(loss, group=pp_group)  # the loss lives on the last stage
        if dp_group is not None:
            loss = loss.clone()
            dist.all_reduce(loss, group=dp_group)
        if self.per_token:
            return float(loss / self._tokens_over_dp(dp_group).clamp(min=1.0))
        return float(loss / (1 if dp_group is None else dist.get_world_size(dp_group)))
