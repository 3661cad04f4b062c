"""Do this project's GPT datasets give Megatron-LM's samples, in its order? Builds the train/valid/test datasets of
a run here and with Megatron-Core (BlendedMegatronDatasetBuilder + GPTDataset, Megatron-LM's split sizes) on the
same .bin/.idx, and prints per split the lengths and how many samples agree (sha1 of each sample's seq_length + 1
token ids), with the first samples and samples 320..335. CPU only; Megatron-LM's sources must have their dataset
helpers built (`make -C MEGATRON/megatron/core/datasets`).

    python scripts/megatron_lm/data_order.py --megatron .anchors/megatron -- \
        --data-path .interop/data/python3.11-docs_text_document --split 98,1,1 --tokenizer-type NullTokenizer \
        --vocab-size 8191 --seq-length 512 --micro-batch-size 4 --global-batch-size 16 --train-iters 40 \
        --eval-interval 20 --eval-iters 10 --seed 1234

(the flags after `--` are this project's pretrain_gpt.py flags; NullTokenizer or any tokenizer with an eod).
Both packages are called `megatron`, so Megatron-Core runs in a child process of this script.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np


def _hashes(datasets) -> dict:
    out = {}
    for name, dataset in zip(("train", "valid", "test"), datasets):
        if dataset is None:
            out[name] = None
            continue
        out[name] = []
        for i in range(len(dataset)):
            sample = dataset[i]
            window = np.concatenate([sample["tokens"].numpy(), sample["labels"].numpy()[-1:]]).astype(np.int64)
            out[name].append(hashlib.sha1(window.tobytes()).hexdigest()[:12])
    return out


def megatron_core(megatron_dir: str, spec: dict) -> dict:
    # Megatron-LM's two packages made by hand, their folders as __path__ (Python finds their modules there, this
    # project's package of the same name out of the way), skipping their __init__ (its training stack, Triton)
    for name in ("megatron", "megatron.core"):
        module = types.ModuleType(name)
        module.__path__ = [str(Path(megatron_dir, *name.split(".")))]
        sys.modules[name] = module
    import megatron.core.parallel_state  # noqa: F401  (its utils <-> parallel_state import cycle)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tokenizer:
        vocab_size, eod, pad = spec["vocab_size"], spec["eod"], -1
        unique_identifiers = {"class": "tokenizer", "eod": spec["eod"]}

    paths = spec["data_path"]
    blend = (paths, None) if len(paths) == 1 else (paths[1::2], [float(w) for w in paths[::2]])
    config = GPTDatasetConfig(
        random_seed=spec["seed"], sequence_length=spec["seq_length"], blend=blend, split=spec["split"],
        path_to_cache=spec["cache"], tokenizer=Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False,
    )  # fmt: skip
    return _hashes(BlendedMegatronDatasetBuilder(GPTDataset, spec["sizes"], lambda: True, config).build())


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        spec = json.loads(Path(sys.argv[3]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(megatron_core(sys.argv[2], spec)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megatron", required=True, help="Megatron-LM's source folder")
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    from megatron.config import parse_args
    from megatron.data import build_datasets, build_tokenizer, padded_vocab_size
    from megatron.data.builder import split_sizes

    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_args([*flags, "--data-cache-path", f"{tmp}/ours"])
        tokenizer = build_tokenizer(cfg.data)
        vocab = padded_vocab_size(tokenizer.vocab_size, cfg.data.make_vocab_size_divisible_by, 1)
        ours = _hashes(vars(build_datasets(cfg, tokenizer, vocab)).values())
        spec = {
            "data_path": cfg.data.data_path, "split": cfg.data.split, "seed": cfg.training.seed,
            "seq_length": cfg.model.seq_length, "sizes": list(split_sizes(cfg)), "cache": f"{tmp}/mcore",
            "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
        }  # fmt: skip
        Path(tmp, "spec.json").write_text(json.dumps(spec))
        subprocess.run([sys.executable, __file__, "--child", args.megatron, f"{tmp}/spec.json"], check=True)
        theirs = json.loads(Path(tmp, "spec.json").read_text())
    print(f"sizes asked (Megatron-LM's formulas): {spec['sizes']}")
    for name in ("train", "valid", "test"):
        a, b = ours[name], theirs[name]
        if a is None or b is None:
            print(f"{name}: here {'none' if a is None else len(a)}, Megatron-Core {'none' if b is None else len(b)}")
            continue
        same = sum(x == y for x, y in zip(a, b))
        print(f"{name}: {len(a)} samples here, {len(b)} in Megatron-Core; the same sample at {same} of them")
        for first, last in ((0, 4), (320, 336)):
            if last <= min(len(a), len(b)):
                agree = all(a[i] == b[i] for i in range(first, last))
                print(f"  samples {first}..{last - 1}: {'identical' if agree else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
