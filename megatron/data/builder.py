"""Build the train / validation / test datasets named by the configuration."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Dataset

from megatron.config import Config
from megatron.config.batch_schedule import train_samples as run_samples
from megatron.config.data import parse_blend, parse_split

from .blended_dataset import BlendedDataset, cached_blend_indices
from .errors import DataError
from .gpt_dataset import GPTDataset
from .indexed_dataset import IndexedDataset
from .mock import MockGPTDataset

SPLIT_NAMES = ("train", "valid", "test")


@dataclass
class Datasets:
    train: Dataset
    valid: Dataset | None
    test: Dataset | None


def split_bounds(fractions: list[float], num_documents: int) -> list[int]:
    """Document boundaries of the splits: split i is documents [b[i], b[i+1]) with b[i] = round(F_i * D) for the
    cumulative fraction F_i, so the splits are contiguous, disjoint and cover all D documents."""
    bounds, cumulative = [0], 0.0
    for fraction in fractions:
        cumulative += fraction
        bounds.append(min(num_documents, int(round(cumulative * num_documents))))
    bounds[-1] = num_documents
    return bounds


def cache_dir_for(prefix: str, data_cache_path: str | None) -> str:
    return data_cache_path or os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")


def build_datasets(cfg: Config, tokenizer, vocab_size: int) -> Datasets:
    """Datasets sized for the whole run: at least the samples its steps consume for training, and eval_iters x
    global batch for validation and test (the same samples at every evaluation); None where eval_iters is 0 or the
    split gives no documents."""
    train_samples = run_samples(cfg)
    eval_samples = cfg.training.eval_iters * cfg.training.global_batch_size
    seq, seed = cfg.model.seq_length, cfg.training.seed
    if cfg.data.mock_data:
        vocab, eod = tokenizer.vocab_size, tokenizer.eod
        return Datasets(
            train=MockGPTDataset(train_samples, seq, vocab, eod, seed),
            valid=MockGPTDataset(eval_samples, seq, vocab, eod, seed + 1) if eval_samples else None,
            test=MockGPTDataset(eval_samples, seq, vocab, eod, seed + 2) if eval_samples else None,
        )
    blend = parse_blend(cfg.data.data_path)
    if not all(np.isfinite(w) and w > 0 for w, _ in blend):  # 1e400 parses as inf, and inf / inf as nan
        raise DataError(f"--data-path {' '.join(cfg.data.data_path)}: a weight is not a finite number: `0.3 /data/a`")
    fractions = parse_split(cfg.data.split)
    indexed = [IndexedDataset(prefix, mmap=cfg.data.mmap_bin_files) for _, prefix in blend]
    bounds = [split_bounds(fractions, ds.num_documents) for ds in indexed]
    splits = []
    for i, (name, num_samples) in enumerate(zip(SPLIT_NAMES, (train_samples, eval_samples, eval_samples))):
        parts = [(w, ds, b[i], b[i + 1]) for (w, _), ds, b in zip(blend, indexed, bounds) if b[i + 1] > b[i]]
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
        splits.append(_build_split(cfg, tokenizer, vocab_size, name, parts, num_samples))
    return Datasets(*splits)


def _tokens(indexed: IndexedDataset, first_doc: int, last_doc: int) -> int:
    """Tokens in documents [first_doc, last_doc)."""
    docs = indexed.document_indices
    return int(indexed.sequence_lengths[docs[first_doc] : docs[last_doc]].sum(dtype=np.int64))


def _build_split(cfg: Config, tokenizer, vocab_size: int, name: str, parts: list, num_samples: int) -> Dataset:
    data = cfg.data

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

    if len(parts) == 1:
        _, indexed, first, last = parts[0]
        return gpt(indexed, first, last, num_samples)
    weights = [w for w, *_ in parts]
    dataset_index, dataset_sample_index = cached_blend_indices(
        weights, num_samples, cache_dir_for(parts[0][1].prefix, data.data_cache_path), name
    )
    counts = np.bincount(dataset_index, minlength=len(parts)).tolist()
    components = [gpt(indexed, first, last, count) for (_, indexed, first, last), count in zip(parts, counts)]
    return BlendedDataset(components, dataset_index, dataset_sample_index)
