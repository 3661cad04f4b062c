"""A deterministic synthetic token stream: training runs with no files.

Sample i is a function of (seed, i) alone: documents are arithmetic progressions modulo the vocabulary (random start
and stride, random length), separated by end-of-document tokens. That is learnable (after two tokens of a document
the rest is predictable), so the loss visibly goes down, and it needs no state, so resuming at any consumed-sample
count reads exactly what an uninterrupted run would have read.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class MockGPTDataset(Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, eod: int, seed: int):
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.eod, self.seed = vocab_size, eod, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        n_tokens = self.vocab_size - 1 if self.eod == self.vocab_size - 1 else self.vocab_size
        pieces, filled = [], 0
        while filled < self.seq_length + 1:
            start, stride = torch.randint(0, n_tokens, (2,), generator=gen).tolist()
            length = int(torch.randint(8, 2 * self.seq_length, (1,), generator=gen))
            document = (start + (stride % 16 + 1) * torch.arange(length)) % n_tokens
            pieces += [document, torch.tensor([self.eod])]
            filled += length + 1
        sample = torch.cat(pieces)[: self.seq_length + 1]
        return {
            "tokens": sample[:-1],
            "labels": sample[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.long),
        }
