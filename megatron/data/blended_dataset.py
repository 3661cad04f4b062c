"""A weighted blend of datasets (`--data-path 0.3 /data/a 0.7 /data/b`), in Megatron-Core's order.

Megatron-Core's BlendedDataset (helpers.cpp, build_blending_indices): sample i of the blend comes from the dataset k
whose share lags most, the first k maximizing w_k * max(i, 1) - c_k (c_k: samples taken from k so far), and is its
c_k-th sample. In every prefix of n samples dataset k then holds w_k n samples within (K + 1) / 2 (tested). The
assignment depends on the weights and the sample count alone; it is cached like the GPT indices.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset

from .errors import DataError
from .index_cache import load_or_build

INDEX_VERSION = 2


def blend_indices(weights: list[float], num_samples: int) -> dict[str, np.ndarray]:
    """dataset_index[i] and dataset_sample_index[i]: which dataset sample i of the blend comes from, and which of
    its samples; Megatron-Core's greedy rule, step for step in the same double-precision arithmetic (a Python loop:
    about a million samples a second; the result is cached)."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    dataset_index = np.empty(num_samples, dtype=np.int16 if len(w) < 2**15 else np.int32)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    ks = range(1, len(w))
    for i in range(num_samples):
        t = float(max(i, 1))
        best, best_error = 0, w[0] * t - counts[0]
        for k in ks:
            error = w[k] * t - counts[k]
            if error > best_error:
                best, best_error = k, error
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}


def cached_blend_indices(
    weights: list[float], num_samples: int, cache_dir: str, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """`blend_indices` through the index cache (memory-mapped): (dataset_index, dataset_sample_index)."""
    description = {"version": INDEX_VERSION, "weights": [float(w) for w in weights], "num_samples": num_samples}
    names = ("dataset_index", "dataset_sample_index")
    arrays, _ = load_or_build(
        cache_dir, f"{name}-blend", description, lambda: blend_indices(weights, num_samples), names
    )
    return arrays["dataset_index"], arrays["dataset_sample_index"]


class BlendedDataset(Dataset):
    """The blend of `datasets` that `cached_blend_indices` laid out; dataset k must hold at least as many samples
    as dataset_index names k."""

    def __init__(self, datasets: list[Dataset], dataset_index: np.ndarray, dataset_sample_index: np.ndarray):
        self.datasets, self.dataset_index, self.dataset_sample_index = datasets, dataset_index, dataset_sample_index
        counts = np.bincount(dataset_index, minlength=len(datasets))
        for k, (dataset, count) in enumerate(zip(datasets, counts)):
            if len(dataset) < count:
                raise DataError(f"blend component {k} holds {len(dataset)} samples, fewer than the {count} it gives")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside the blend's {len(self)} samples")
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample_index[index])]
