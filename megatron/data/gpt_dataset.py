"""GPT pretraining samples cut from an indexed dataset: fixed windows over a shuffled stream of documents.

One epoch is the split's documents in a seeded random order, concatenated into a stream of T tokens. Sample j of
the epoch is the window of seq_length + 1 tokens starting at token j * seq_length, so consecutive windows share one
token (the last label of one is the first input of the next) and every token of the stream is an input exactly once
in

    S = (T - 1) // seq_length

samples per epoch; the final (T - 1) mod seq_length tokens (< seq_length) are left out of that epoch. Windows run
across document boundaries. The samples of an epoch are then read in a second seeded random order, so consecutive
samples come from different places. Dataset sample i is sample `perm_e[i mod S]` of epoch e = i // S, where both
orders of epoch e come from a generator seeded with (seed, e): sample i depends on the data, the seed and i alone,
which is what makes resuming from a consumed-sample count exact. The orders are cached (see index_cache.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from .errors import DataError
from .index_cache import file_fingerprint, load_or_build
from .indexed_dataset import IndexedDataset

INDEX_VERSION = 1  # bump when the index construction changes, so old cache entries are not reused


def ltor_masks(
    tokens: np.ndarray, eod: int, reset_position_ids: bool, reset_attention_mask: bool, eod_mask_loss: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Loss mask [s] float32, position ids [s] int64 and (with reset_attention_mask) attention mask [1, s, s] bool
    for left-to-right training on `tokens` [s] (numpy: cheap, and free of torch's intra-op threads in workers).

    A document ends at an input position holding `eod`; position j belongs to segment seg[j] = number of eods at
    positions < j. With resets, positions restart at 0 at each segment's first token, and query j may attend to key
    k iff k <= j and seg[k] == seg[j]. True means "may attend" (what scaled_dot_product_attention takes), the
    opposite of Megatron-LM's mask where True means "masked out". With eod_mask_loss, positions whose input is
    `eod` (which would predict the next document's first token) get loss weight 0.
    """
    s = tokens.size
    is_eod = tokens == eod
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    positions = np.arange(s, dtype=np.int64)
    position_ids = positions
    if reset_position_ids:
        # Start of j's segment: one past the last eod before j (0 if none); a running maximum carries it forward.
        next_start = np.where(is_eod, positions + 1, 0)
        segment_start = np.concatenate([[0], np.maximum.accumulate(next_start)[:-1]])
        position_ids = positions - segment_start
    attention_mask = None
    if reset_attention_mask:
        segment = np.cumsum(is_eod) - is_eod
        causal = positions[None, :] <= positions[:, None]
        attention_mask = (causal & (segment[:, None] == segment[None, :]))[None]
    return loss_mask, position_ids, attention_mask


def build_epoch_orders(
    document_indices: np.ndarray, sequence_lengths: np.ndarray, num_epochs: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """The index arrays of `num_epochs` epochs over the documents whose sequences `document_indices` delimits
    (entries d..d+1 of the .idx document indices, already cut to the split).

    sequence_order[e]: sequence ids in the order epoch e reads them (whole documents, shuffled);
    token_start[e][p]: stream offset of the p-th sequence of epoch e (with the total T at the end);
    sample_order[e]: the permutation of the epoch's S windows.
    """
    num_docs = len(document_indices) - 1
    first_seq, counts = document_indices[:-1], np.diff(document_indices)
    total_tokens = int(sequence_lengths[document_indices[0] : document_indices[-1]].sum(dtype=np.int64))
    samples = (total_tokens - 1) // seq_length
    num_seqs = int(counts.sum())
    seq_dtype = np.int32 if document_indices[-1] < 2**31 else np.int64
    sequence_order = np.empty((num_epochs, num_seqs), dtype=seq_dtype)
    token_start = np.empty((num_epochs, num_seqs + 1), dtype=np.int64)
    sample_order = np.empty((num_epochs, samples), dtype=np.int32 if samples < 2**31 else np.int64)
    for epoch in range(num_epochs):
        rng = np.random.default_rng([seed, epoch])
        docs = rng.permutation(num_docs)
        # Expand each chosen document to its run of sequence ids: start of its run + 0, 1, ..., count - 1.
        run_counts = counts[docs]
        run_offsets = np.repeat(np.cumsum(run_counts) - run_counts, run_counts)
        order = np.repeat(first_seq[docs], run_counts) + (np.arange(num_seqs) - run_offsets)
        sequence_order[epoch] = order
        token_start[epoch, 0] = 0
        np.cumsum(sequence_lengths[order], dtype=np.int64, out=token_start[epoch, 1:])
        sample_order[epoch] = rng.permutation(samples)
    return {"sequence_order": sequence_order, "token_start": token_start, "sample_order": sample_order}


class GPTDataset(Dataset):
    """At least `num_samples` samples (whole epochs) of `seq_length` tokens from documents [first_doc, last_doc) of
    `indexed`. Each sample is {tokens, labels, loss_mask, position_ids} (+ attention_mask), see `ltor_masks`; with
    `vocab_size`, a token id outside [0, vocab_size) is an error naming the dataset."""

    def __init__(
        self,
        indexed: IndexedDataset,
        first_doc: int,
        last_doc: int,
        num_samples: int,
        seq_length: int,
        seed: int,
        eod: int,
        cache_dir: str,
        vocab_size: int | None = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
        name: str = "train",
    ):
        self.indexed, self.seq_length, self.eod, self.vocab_size = indexed, seq_length, eod, vocab_size
        self.reset_position_ids, self.reset_attention_mask = reset_position_ids, reset_attention_mask
        self.eod_mask_loss = eod_mask_loss
        document_indices = np.asarray(indexed.document_indices[first_doc : last_doc + 1])
        lengths = indexed.sequence_lengths
        tokens = int(lengths[document_indices[0] : document_indices[-1]].sum(dtype=np.int64))
        self.samples_per_epoch = (tokens - 1) // seq_length
        if self.samples_per_epoch < 1:
            raise DataError(
                f"{indexed.prefix}: the {name} split (documents {first_doc}..{last_doc - 1}) holds {tokens} tokens,"
                f" too few for one sample of --seq-length {seq_length} + 1; use more data or change --split"
            )
        self.num_epochs = max(1, -(-num_samples // self.samples_per_epoch))
        description = {
            "version": INDEX_VERSION,
            "idx": file_fingerprint(indexed.idx_path),
            "bin": file_fingerprint(indexed.bin_path),
            "documents": [first_doc, last_doc],
            "seq_length": seq_length,
            "seed": seed,
            "num_epochs": self.num_epochs,
        }
        stem = f"{name}-{indexed.prefix.rstrip('/').split('/')[-1]}"
        arrays, self.built_index = load_or_build(
            cache_dir,
            stem,
            description,
            lambda: build_epoch_orders(document_indices, lengths, self.num_epochs, seq_length, seed),
        )
        self.sequence_order, self.token_start = arrays["sequence_order"], arrays["token_start"]
        self.sample_order = arrays["sample_order"]

    def __len__(self) -> int:
        return self.num_epochs * self.samples_per_epoch

    def window(self, epoch: int, sample: int) -> np.ndarray:
        """Stream tokens [sample * s, sample * s + s + 1) of `epoch` (before the sample shuffle), as int64."""
        starts, order = self.token_start[epoch], self.sequence_order[epoch]
        begin = sample * self.seq_length
        end = begin + self.seq_length + 1
        p = int(np.searchsorted(starts, begin, side="right")) - 1
        pieces = []
        while begin < end:
            take = min(end, int(starts[p + 1])) - begin
            if take > 0:
                pieces.append(self.indexed.get(int(order[p]), begin - int(starts[p]), take))
            begin += take
            p += 1
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside the dataset's {len(self)} samples")
        epoch, j = divmod(int(index), self.samples_per_epoch)
        window = self.window(epoch, int(self.sample_order[epoch, j]))
        if self.vocab_size is not None and (window.max() >= self.vocab_size or window.min() < 0):
            # Caught here, not as an index error deep in the embedding (a device-side assert on a GPU).
            raise DataError(
                f"{self.indexed.prefix}: token id {int(window.max())} is outside the model's vocabulary of"
                f" {self.vocab_size}: the data was tokenized by another tokenizer (check the tokenizer flags)"
            )
        tokens, labels = window[:-1], window[1:]
        loss_mask, position_ids, attention_mask = ltor_masks(
            tokens, self.eod, self.reset_position_ids, self.reset_attention_mask, self.eod_mask_loss
        )
        out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if attention_mask is not None:
            out["attention_mask"] = attention_mask
        return {key: torch.from_numpy(value) for key, value in out.items()}
