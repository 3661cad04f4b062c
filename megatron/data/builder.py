"""Build the train / validation / test datasets named by the configuration, as Megatron-LM's
BlendedMegatronDatasetBuilder does: the same sizes, splits, blend layout and so the same samples in the same order."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
from torch.utils.data import ConcatDataset, Dataset

from megatron.config import Config
from megatron.config.batch_schedule import train_iterations
from megatron.config.batch_schedule import train_samples as run_samples
from megatron.config.data import parse_blend, parse_split

from .blended_dataset import BlendedDataset, cached_blend_indices
from .errors import DataError
from .gpt_dataset import GPTDataset
from .indexed_dataset import IndexedDataset
from .mock import MockGPTDataset

SPLIT_NAMES = ("train", "valid", "test")
MID_LEVEL_SURPLUS = 0.005
"""Megatron-LM's --mid-level-dataset-surplus default: each blend component is built for this much more than its
share (the component's index, and so its order, depends on that count)."""


@dataclass
class Datasets:
    train: Dataset
    valid: Dataset | None
    test: Dataset | None


def split_bounds(fractions: list[float], num_documents: int) -> list[int]:
    """Boundaries of the splits: split i is elements [b[i], b[i+1]) with b[i] = round(F_i * D) for the cumulative
    fraction F_i (Megatron-Core's rounding), so the splits are contiguous, disjoint and cover all D elements."""
    bounds, cumulative = [0], 0.0
    for fraction in fractions:
        cumulative += fraction
        bounds.append(min(num_documents, int(round(cumulative * num_documents))))
    bounds[-1] = num_documents
    return bounds


def cache_dir_for(prefix: str, data_cache_path: str | None) -> str:
    return data_cache_path or os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")


def split_sizes(cfg: Config) -> tuple[int, int, int]:
    """Samples asked of the train, validation and test datasets: Megatron-LM's get_train_valid_test_num_samples.
    Training: --train-samples, else train_iters x global batch (at least what a batch-size schedule consumes);
    validation: eval_iters x global batch for each evaluation of the run (every --eval-interval-th step and once at
    the end, each reading the next samples), or one evaluation's with --full-validation (mock data; a corpus's
    validation split is then read in full, see `_build_split`); test: one evaluation."""
    train, gbs = cfg.training, cfg.training.global_batch_size
    iterations = train_iterations(cfg)
    samples = train.train_samples if train.train_samples is not None else iterations * gbs
    evaluations = iterations // train.eval_interval + 1
    valid = (1 if train.full_validation else evaluations) * train.eval_iters * gbs
    return max(samples, run_samples(cfg)), valid, train.eval_iters * gbs


def build_datasets(cfg: Config, tokenizer, vocab_size: int) -> Datasets:
    """Datasets sized for the whole run (`split_sizes`); None where eval_iters is 0 or the split gives no
    documents. The splits cut each prefix's sequences (documents, unless preprocessed with sentence splitting), as
    Megatron-Core's GPT datasets do."""
    train_samples, valid_samples, test_samples = split_sizes(cfg)
    seq, seed = cfg.model.seq_length, cfg.training.seed
    if cfg.data.mock_data:
        vocab, eod = tokenizer.vocab_size, tokenizer.eod
        return Datasets(
            train=MockGPTDataset(train_samples, seq, vocab, eod, seed),
            valid=MockGPTDataset(valid_samples, seq, vocab, eod, seed + 1) if valid_samples else None,
            test=MockGPTDataset(test_samples, seq, vocab, eod, seed + 2) if test_samples else None,
        )
    blend = parse_blend(cfg.data.data_path)
    if not all(np.isfinite(w) and w > 0 for w, _ in blend):  # 1e400 parses as inf, and inf / inf as nan
        raise DataError(f"--data-path {' '.join(cfg.data.data_path)}: a weight is not a finite number: `0.3 /data/a`")
    fractions = parse_split(cfg.data.split)
    indexed = [IndexedDataset(prefix, mmap=cfg.data.mmap_bin_files) for _, prefix in blend]
    bounds = [split_bounds(fractions, len(ds.sequence_lengths)) for ds in indexed]
    weighted = len(cfg.data.data_path) > 1  # Megatron-LM blends a weighted prefix even when it is the only one
    raw_weights = [float(w) for w in cfg.data.data_path[::2]] if weighted else [1.0]  # normalized as Megatron-LM does
    splits = []
    for i, (name, num_samples) in enumerate(zip(SPLIT_NAMES, (train_samples, valid_samples, test_samples))):
        parts = [(w, ds, b[i], b[i + 1]) for w, ds, b in zip(raw_weights, indexed, bounds) if b[i + 1] > b[i]]
        if name == "train" and not parts:
            raise DataError(f"--split {cfg.data.split} leaves no documents for training; give the first entry a share")
        if name != "train":
            # Evaluation uses the components whose share of the split fills at least one sample (the weights of the
            # rest are renormalized away, with a warning); training insists on every component.
            usable = []
            for part in parts:
                _, ds, first, last = part
                tokens = _tokens(ds, first, last)
                if tokens > seq:
                    usable.append(part)
                else:
                    warnings.warn(
                        f"{ds.prefix}: the {name} split (documents {first}..{last - 1}) holds {tokens} tokens, too few"
                        f" for one sample of --seq-length {seq} + 1; {name} leaves it out",
                        stacklevel=2,
                    )
            if not usable or num_samples == 0:
                splits.append(None)
                continue
            parts = usable
        splits.append(_build_split(cfg, tokenizer, vocab_size, name, parts, num_samples, weighted))
    valid, gbs = splits[1], cfg.training.global_batch_size
    if cfg.training.full_validation and valid is not None and len(valid) < gbs:
        raise DataError(
            f"--full-validation: the validation split holds {len(valid)} samples of --seq-length"
            f" {cfg.model.seq_length}, fewer than one global batch ({gbs}); give it a larger share in --split"
        )
    return Datasets(*splits)


def _tokens(indexed: IndexedDataset, first: int, last: int) -> int:
    """Tokens in sequences [first, last)."""
    return int(indexed.sequence_lengths[first:last].sum(dtype=np.int64))


def _build_split(
    cfg: Config, tokenizer, vocab_size: int, name: str, parts: list, num_samples: int, weighted: bool
) -> Dataset:
    data = cfg.data
    if name == "valid" and cfg.training.full_validation:
        num_samples = 1  # one epoch: the fewest a GPT dataset holds

    def gpt(indexed: IndexedDataset, first: int, last: int, samples: int) -> GPTDataset:
        return GPTDataset(
            indexed,
            first,
            last,
            samples,
            cfg.model.seq_length,
            cfg.training.seed,
            tokenizer.eod,
            cache_dir_for(indexed.prefix, data.data_cache_path),
            vocab_size=vocab_size,
            reset_position_ids=data.reset_position_ids,
            reset_attention_mask=data.reset_attention_mask,
            eod_mask_loss=data.eod_mask_loss,
            name=name,
        )

    if not weighted:
        _, indexed, first, last = parts[0]
        return gpt(indexed, first, last, num_samples)
    if name == "valid" and cfg.training.full_validation:  # every component's split in full, not weighted
        return ConcatDataset([gpt(indexed, first, last, num_samples) for _, indexed, first, last in parts])
    # Megatron-LM's sizes: component k serves ceil(n w_k) samples and is built for that plus the surplus; the blend
    # holds the sum of the shares.
    raw = np.array([w for w, *_ in parts], dtype=np.float64)
    weights = (raw / np.sum(raw)).tolist()
    shares = [math.ceil(num_samples * w) for w in weights]
    size = sum(shares)
    dataset_index, dataset_sample_index = cached_blend_indices(
        weights, size, cache_dir_for(parts[0][1].prefix, data.data_cache_path), name
    )
    components = [
        gpt(indexed, first, last, math.ceil(share * (1 + MID_LEVEL_SURPLUS)))
        for (_, indexed, first, last), share in zip(parts, shares)
    ]
    return BlendedDataset(components, dataset_index, dataset_sample_index)
