"""Which samples each rank reads: Megatron-LM's pretraining order.

Global batch k covers samples [k*G, (k+1)*G) of the dataset; it is cut into chunks of micro_batch x dp_size, and
data-parallel rank r takes the r-th micro-batch of every chunk. Starting from `consumed_samples` resumes exactly
where a checkpoint stopped: nothing replayed, nothing skipped.
"""

from __future__ import annotations

from collections.abc import Iterator


class PretrainingSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if consumed_samples > total_samples:
            raise ValueError(f"consumed samples {consumed_samples} exceed the dataset's {total_samples} samples")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        chunk = self.micro_batch_size * self.dp_size
        first = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - chunk + 1, chunk):
            yield list(range(start + first, start + first + self.micro_batch_size))
