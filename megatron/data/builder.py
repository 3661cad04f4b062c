"""Build the train / validation / test datasets named by the configuration."""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import Dataset

from megatron.config import Config

from .mock import MockGPTDataset


@dataclass
class Datasets:
    train: Dataset
    valid: Dataset | None
    test: Dataset | None


def build_datasets(cfg: Config, tokenizer, vocab_size: int) -> Datasets:
    """Datasets sized for the whole run: train_iters x global batch for training, and (eval runs + 1) x
    eval_iters x global batch for validation and test (valid samples are the same at every evaluation)."""
    train_samples = cfg.training.train_iters * cfg.training.global_batch_size
    eval_samples = cfg.training.eval_iters * cfg.training.global_batch_size
    seq, seed = cfg.model.seq_length, cfg.training.seed
    if cfg.data.mock_data:
        return Datasets(
            train=MockGPTDataset(train_samples, seq, tokenizer.vocab_size, tokenizer.eod, seed),
            valid=MockGPTDataset(eval_samples, seq, tokenizer.vocab_size, tokenizer.eod, seed + 1) if eval_samples else None,
            test=MockGPTDataset(eval_samples, seq, tokenizer.vocab_size, tokenizer.eod, seed + 2) if eval_samples else None,
        )
    raise NotImplementedError("--data-path datasets are not implemented yet")
