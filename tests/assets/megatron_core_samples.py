"""Which samples Megatron-Core's GPT datasets give, in which order, as a small JSON (megatron_core_samples.json) that
tests/unit/test_data_megatron_order.py compares this project's datasets against, without importing Megatron-LM.

The data: synthetic `.bin`/`.idx` pairs (int32 token ids counting up, so every window is distinct), the documents'
lengths drawn from numpy's default_rng with the seeds in CASES; the test writes the same documents with
tests/assets/data_helpers.write_documents. Each case is a run's flags (one prefix, or a weighted blend of two);
the sizes asked of the three splits are Megatron-LM's get_train_valid_test_num_samples (train_iters x gbs;
(train_iters // eval_interval + 1) x eval_iters x gbs; eval_iters x gbs), the datasets built by
BlendedMegatronDatasetBuilder(GPTDataset, sizes, ..., GPTDatasetConfig(random_seed, sequence_length, blend, split,
...)). The cases cover one epoch, several epochs with and without Megatron-Core's separate final epoch, and a blend.
For every split: its length, the sha1 (12 hex digits) of the int64 tokens + final label (seq_length + 1 ids) of
samples 0..47 and 320..335 (where they exist), and one sha1 over all its samples' windows in order.

Made with Megatron-LM d98e8a64 (the sources in .anchors/megatron, its C++ helpers built for this Python), numpy
2.x, on 2026-11-26:

    python tests/assets/megatron_core_samples.py .anchors/megatron > tests/assets/megatron_core_samples.json
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

SEQ, GBS = 32, 8
CASES = {
    # name: documents per prefix (rng seed, count, first token id), data path (weights, if any), run flags
    "single": {
        "prefixes": [(7, 300, 0)],
        "weights": None,
        "split": "90,6,4",
        "train_iters": 200,  # 1600 samples: two epochs, the last one large (not separate)
        "eval_interval": 50,  # validation: 120 samples, three epochs, the last one separate
        "eval_iters": 3,
        "seed": 1234,
    },
    "single_separate": {
        "prefixes": [(7, 300, 0)],
        "weights": None,
        "split": "90,6,4",
        "train_iters": 120,  # 960 samples: two epochs, the last one small (separate)
        "eval_interval": 40,
        "eval_iters": 2,
        "seed": 5,
    },
    "blend": {
        "prefixes": [(7, 300, 0), (8, 200, 1_000_000)],
        "weights": [0.3, 0.7],
        "split": "90,6,4",
        "train_iters": 30,
        "eval_interval": 10,
        "eval_iters": 2,
        "seed": 1234,
    },
}
SHOWN = list(range(48)) + list(range(320, 336))


def lengths(seed: int, count: int) -> list[int]:
    return [int(n) for n in np.random.default_rng(seed).integers(1, 200, size=count)]


def sizes(case: dict) -> list[int]:
    evaluations = case["train_iters"] // case["eval_interval"] + 1
    return [case["train_iters"] * GBS, evaluations * case["eval_iters"] * GBS, case["eval_iters"] * GBS]


def window_hash(window: np.ndarray) -> str:
    return hashlib.sha1(np.asarray(window, dtype=np.int64).tobytes()).hexdigest()[:12]


def describe(dataset, window_of) -> dict:
    """len, the hashes of the SHOWN samples, and a digest of all samples' windows in order."""
    digest = hashlib.sha1()
    shown = {}
    for i in range(len(dataset)):
        window = np.asarray(window_of(dataset, i), dtype=np.int64)
        digest.update(window.tobytes())
        if i in SHOWN:
            shown[str(i)] = window_hash(window)
    return {"len": len(dataset), "samples": shown, "digest": digest.hexdigest()}


def _write(prefix: Path, lens: list[int], first_token: int) -> None:
    """The .bin/.idx pair of write_documents(prefix, lens, first_token) (int32, one sequence per document)."""
    total = sum(lens)
    np.arange(first_token, first_token + total, dtype=np.int32).tofile(f"{prefix}.bin")
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) * 4
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(np.array([1], dtype=np.uint64).tobytes() + np.array([4], dtype=np.uint8).tobytes())
        f.write(np.array([len(lens), len(lens) + 1], dtype=np.uint64).tobytes())
        f.write(np.array(lens, dtype=np.int32).tobytes() + offsets.tobytes())
        f.write(np.arange(len(lens) + 1, dtype=np.int64).tobytes())


def main(megatron_dir: str) -> None:
    # Megatron-Core's package __init__ pulls in its whole training stack (Triton included); the datasets need none
    # of it, so its packages are entered without running their __init__.
    sys.path.insert(0, megatron_dir)
    for name in ("megatron", "megatron.core"):
        module = types.ModuleType(name)
        module.__path__ = [str(Path(megatron_dir, *name.split(".")))]
        sys.modules[name] = module
    import megatron.core.parallel_state  # noqa: F401  (breaks its utils <-> parallel_state import cycle)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tokenizer:  # what GPTDataset asks of one: eod, pad (none), an identity for its cache
        vocab_size, eod, pad = 2_000_000, 1_999_999, -1
        unique_identifiers = {"class": "NullTokenizer"}

    def window_of(dataset, i):
        sample = dataset[i]
        return np.concatenate([sample["tokens"].numpy(), sample["labels"].numpy()[-1:]])

    out = {"seq_length": SEQ, "global_batch_size": GBS, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            prefixes = []
            for k, (seed, count, first) in enumerate(case["prefixes"]):
                prefix = Path(tmp, f"{name}_{k}")
                _write(prefix, lengths(seed, count), first)
                prefixes.append(str(prefix))
            config = GPTDatasetConfig(
                random_seed=case["seed"],
                sequence_length=SEQ,
                blend=(prefixes, case["weights"]),
                split=case["split"],
                path_to_cache=str(Path(tmp, "cache")),
                tokenizer=Tokenizer(),
                reset_position_ids=False,
                reset_attention_mask=False,
                eod_mask_loss=False,
                create_attention_mask=False,
            )
            built = BlendedMegatronDatasetBuilder(GPTDataset, sizes(case), lambda: True, config).build()
            splits = {s: describe(d, window_of) for s, d in zip(("train", "valid", "test"), built) if d is not None}
            out["cases"][name] = {**case, "sizes": sizes(case), "splits": splits}
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
