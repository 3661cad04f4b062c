"""A weighted blend of datasets (`--data-path 0.3 /data/a 0.7 /data/b`), deterministic and evenly interleaved.

Dataset k with weight w_k (weights sum to 1) contributes its j-th sample at the "ideal time" (j + 1/2) / w_k, and
the blend lists all contributions in order of ideal time (ties: lower k first). By time t dataset k has contributed
floor(t w_k + 1/2) samples, so in every prefix of n blended samples dataset k holds w_k n samples up to
+-(K + 1)/2 for K datasets: the proportions hold over any window of training, not just on average. The assignment
depends on the weights and the sample count alone; it is cached like the GPT indices.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset

from .errors import DataError
from .index_cache import load_or_build

INDEX_VERSION = 1


def blend_indices(weights: list[float], num_samples: int, chunk: int = 1 << 22) -> dict[str, np.ndarray]:
    """dataset_index[i] and dataset_sample_index[i]: which dataset sample i of the blend comes from, and which of
    its samples. Built in windows of `chunk` time units, so memory stays O(chunk) beyond the outputs."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    dataset_index = np.empty(num_samples, dtype=np.int16 if len(w) < 2**15 else np.int32)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    filled, t0 = 0, 0.0
    while filled < num_samples:
        t1 = t0 + chunk
        # Samples of dataset k with ideal time in [t0, t1): j from ceil(t0 w - 1/2) to ceil(t1 w - 1/2) - 1.
        lo = np.ceil(t0 * w - 0.5).clip(min=0).astype(np.int64)
        hi = np.ceil(t1 * w - 0.5).clip(min=0).astype(np.int64)
        ks = np.repeat(np.arange(len(w)), hi - lo)
        js = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])
        order = np.lexsort((ks, (js + 0.5) / w[ks]))  # by time, then by dataset
        take = min(len(order), num_samples - filled)
        dataset_index[filled : filled + take] = ks[order[:take]]
        dataset_sample_index[filled : filled + take] = js[order[:take]]
        filled += take
        t0 = t1
    return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}


def cached_blend_indices(
    weights: list[float], num_samples: int, cache_dir: str, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """`blend_indices` through the index cache (memory-mapped): (dataset_index, dataset_sample_index)."""
    description = {"version": INDEX_VERSION, "weights": [float(w) for w in weights], "num_samples": num_samples}
    arrays, _ = load_or_build(cache_dir, f"{name}-blend", description, lambda: blend_indices(weights, num_samples))
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
