"""Optional statistics of the progress line and TensorBoard: --log-params-norm, --log-num-zeros-in-grad and
--log-memory-to-tensorboard.

Both counts cover the whole model once, whatever the layout: each rank contributes the parameters (or, with the
distributed optimizer, the pieces of them) whose gradients it counts in the gradient norm (`counts_in_grad_norm`:
tensor-parallel duplicates and the last stage's tied embedding left out), summed over the same ranks as the gradient
norm (`megatron.parallel.grad_norm`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.config.training import LoggingConfig
from megatron.parallel import ParallelDims, grad_norm


class Stats:
    def __init__(self, cfg: LoggingConfig, dims: ParallelDims, optimizer, sharded: bool, device: torch.device):
        self.cfg, self.dims, self.optimizer, self.sharded, self.device = cfg, dims, optimizer, sharded, device
        self._zeros: torch.Tensor | None = None

    def _sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.sharded and self.dims.dp_cp_group is not None:
            dist.all_reduce(value)  # data x model parallel ranks: the whole world
        elif self.dims.mp_group is not None:
            dist.all_reduce(value, group=self.dims.mp_group)
        return value

    def count_zeros(self) -> None:
        """Count the zeros of the gradients the optimizer is about to use (call after their reductions, before
        the step). Stays on the device until the log line reads it."""
        if not self.cfg.log_num_zeros_in_grad:
            return
        grads = self.optimizer.norm_grads()
        zeros = torch.zeros((), dtype=torch.int64, device=self.device)
        for grad in grads:
            zeros += grad.numel() - torch.count_nonzero(grad)
        self._zeros = self._sum(zeros)

    def params_norm(self) -> float:
        """L2 norm of the fp32 main parameters over the whole model (every rank calls it)."""
        with torch.no_grad():
            return float(grad_norm(self.optimizer.norm_params(), self.dims, self.sharded, self.device))

    def report(self) -> tuple[list[str], dict[str, float]]:
        """Fields for the progress line (after the grad norm, Megatron-LM's order) and TensorBoard scalars."""
        fields: list[str] = []
        scalars: dict[str, float] = {}
        if self._zeros is not None:
            zeros = int(self._zeros)
            fields.append(f"num zeros: {zeros}")
            scalars["num-zeros"] = zeros
        if self.cfg.log_params_norm:
            norm = self.params_norm()
            fields.append(f"params norm: {norm:.3f}")
            scalars["params-norm"] = norm
        if self.cfg.log_memory_to_tensorboard and self.device.type == "cuda":
            mem = torch.cuda.memory_stats(self.device)
            scalars["mem-reserved-bytes"] = mem["reserved_bytes.all.current"]
            scalars["mem-allocated-bytes"] = mem["allocated_bytes.all.current"]
            scalars["mem-max-allocated-bytes"] = mem["allocated_bytes.all.peak"]
            scalars["mem-allocated-count"] = mem["allocation.all.current"]
        return fields, scalars
