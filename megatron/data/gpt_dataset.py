"""GPT pretraining samples cut from an indexed dataset, in Megatron-Core's order (its GPTDataset, sample for sample).

The split's sequences, repeated for E epochs (the fewest whose tokens cover `num_samples` samples), are shuffled
with numpy's `RandomState(seed)` into the document index and concatenated into one stream of E * T tokens. Sample j
is the window of seq_length + 1 tokens starting at stream token j * seq_length (consecutive windows share one token:
the last label of one is the first input of the next), so windows run across document and epoch boundaries and the
dataset holds (E * T - 1) // seq_length samples. Dataset sample i is window shuffle_index[i], a second permutation
drawn from the same RandomState. When the last epoch would give less than 80% of an epoch's samples to the
requested `num_samples`, Megatron-Core shuffles that epoch's documents and windows apart from the others' ("separate
final epoch"), and so does this module. Sample i depends on the data, the seed, seq_length and num_samples alone,
which is what makes resuming from a consumed-sample count exact. The orders are cached (see index_cache.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from .errors import DataError
from .index_cache import file_fingerprint, load_or_build
from .indexed_dataset import IndexedDataset

INDEX_VERSION = 2  # bump when the index construction changes, so old cache entries are not reused


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


def num_epochs_for(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    """The fewest epochs whose tokens hold `num_samples` windows of seq_length + 1 tokens (at least 1)."""
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_indices(
    sequence_ids: np.ndarray, sequence_lengths: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """Megatron-Core's GPTDataset indices (gpt_dataset.py, _build_document_sample_shuffle_indices) for the sequences
    `sequence_ids` of a split: document_index (the sequence read at each place of the stream, int32),
    token_start (the stream offset of each place, with the total at the end; Megatron-Core's sample index says the
    same in (place, offset) pairs) and shuffle_index (dataset sample -> window, uint32)."""
    tokens_per_epoch = int(sequence_lengths[sequence_ids].sum(dtype=np.int64))
    num_epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    separate_final_epoch = False
    if num_epochs > 1:
        before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = num_samples - before_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    ids = np.asarray(sequence_ids, dtype=np.int32)
    if separate_final_epoch:
        document_index = np.concatenate([_shuffled(np.tile(ids, num_epochs - 1), rng), _shuffled(ids.copy(), rng)])
    else:
        document_index = _shuffled(np.tile(ids, num_epochs), rng)
    token_start = np.zeros(len(document_index) + 1, dtype=np.int64)
    np.cumsum(sequence_lengths[document_index], dtype=np.int64, out=token_start[1:])
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = before_final if separate_final_epoch else total
    shuffle_index = _shuffled(np.arange(first, dtype=dtype), rng)
    if first < total:
        shuffle_index = np.concatenate([shuffle_index, _shuffled(np.arange(first, total, dtype=dtype), rng)])
    return {"document_index": document_index, "token_start": token_start, "shuffle_index": shuffle_index}


def _shuffled(values: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    rng.shuffle(values)  # in place, as Megatron-Core draws it: same RandomState, same call order
    return values


class GPTDataset(Dataset):
    """At least `num_samples` samples of `seq_length` tokens from sequences [first, last) of `indexed` (documents,
    unless the data was preprocessed with sentence splitting: Megatron-Core splits sequences), in Megatron-Core's
    order (see `build_indices`). Each sample is {tokens, labels, loss_mask, position_ids} (+ attention_mask), see
    `ltor_masks`; with `vocab_size`, a token id outside [0, vocab_size) is an error naming the dataset."""

    def __init__(
        self,
        indexed: IndexedDataset,
        first: int,
        last: int,
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
        lengths = indexed.sequence_lengths
        tokens = int(lengths[first:last].sum(dtype=np.int64))
        if tokens <= seq_length:
            raise DataError(
                f"{indexed.prefix}: the {name} split (documents {first}..{last - 1}) holds {tokens} tokens,"
                f" too few for one sample of --seq-length {seq_length} + 1; use more data or change --split"
            )
        self.num_epochs = num_epochs_for(tokens, num_samples, seq_length)
        self.samples_per_epoch = (tokens - 1) // seq_length
        description = {
            "version": INDEX_VERSION,
            "idx": file_fingerprint(indexed.idx_path),
            "bin": file_fingerprint(indexed.bin_path),
            "sequences": [first, last],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
        }
        stem = f"{name}-{indexed.prefix.rstrip('/').split('/')[-1]}"
        ids = np.arange(first, last, dtype=np.int32)
        arrays, self.built_index = load_or_build(
            cache_dir,
            stem,
            description,
            lambda: build_indices(ids, lengths, num_samples, seq_length, seed),
            ("document_index", "token_start", "shuffle_index"),
        )
        self.document_index, self.token_start = arrays["document_index"], arrays["token_start"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def window(self, sample: int) -> np.ndarray:
        """Stream tokens [sample * s, sample * s + s + 1) (window `sample`, before the shuffle), as int64."""
        starts, order = self.token_start, self.document_index
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
        window = self.window(int(self.shuffle_index[index]))
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
