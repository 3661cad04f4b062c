"""Every malformed input is one line: seeded mutations of what users hand this project, each fed to the entry function
that pretrain_gpt.py or tools/checkpoint/convert.py calls (whose main turns the project's one-line error into exit 2;
a few real runs at the end check that). Each case must load or raise that error naming the file, in time, without
touching the files beside it; the counts per format are printed (pytest -s) and checked against a floor."""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from megatron.checkpoint.integrity import local_checksums, record_checksums
from megatron.checkpoint.safe_load import SafeLoadPlanner, SafeReader
from megatron.config import parse_args
from megatron.training import Trainer
from tests.unit.ckpt_files import tree_digest
from tests.unit.fuzz_mutations import Tally, mutate_bytes, mutate_tree, random_value

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets" / "old_checkpoints"
FLAGS = json.loads((ASSETS / "expected.json").read_text())["flags"]
SEED = 20261125
TALLY = Tally()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """The model, optimizer and checkpointer of the fixture's run: `trainer.checkpointer.load` is what --load runs."""
    empty = tmp_path_factory.mktemp("empty")  # --load of a folder without checkpoints: nothing loaded
    return Trainer(parse_args(f"{FLAGS} --train-iters 6 --load {empty}".split(), world_size=1))


def _case_dir(tmp_path: Path, fmt: str) -> Path:
    root = tmp_path / fmt
    shutil.copytree(ASSETS / fmt, root)
    return root


def _load_case(tally_name, trainer, root: Path, file: Path, data: bytes, checksums: str) -> None:
    """Write `data` into `file` of the checkpoint under `root`, with the recorded checksums redone ("redo", as a
    hand edit would), left ("stale") or dropped ("none"); load it; restore the original. The other files must be
    untouched and no file added."""
    folder = root / "iter_0000004"
    original, meta = file.read_bytes(), (folder / "metadata.json").read_bytes()
    others = {k: v for k, v in tree_digest(root).items() if root / k not in (file, folder / "metadata.json")}
    try:
        file.write_bytes(data)
        if checksums == "redo":
            record_checksums(folder, local_checksums(folder))
        elif checksums == "none":
            info = json.loads((folder / "metadata.json").read_text())
            info.pop("checksums", None)
            (folder / "metadata.json").write_text(json.dumps(info))
        TALLY.run(tally_name, lambda: trainer.checkpointer.load(str(root)), [str(root)])
        after = tree_digest(root)
        assert {k: v for k, v in after.items() if k in others} == others and after.keys() == {
            *others,
            file.relative_to(root).as_posix(),
            "iter_0000004/metadata.json",
        }
    finally:
        file.write_bytes(original)
        (folder / "metadata.json").write_bytes(meta)


def _modes(rng: random.Random) -> str:
    return rng.choices(["redo", "stale", "none"], [0.7, 0.15, 0.15])[0]


POINTERS = ["", "4 ", "04", "+4", "-4", "4.0", "٤", "²", "4\x00", "release", "9" * 40, "0", "3", "5", "1e3", "0x4"]


def test_fuzz_checkpoint_files(tmp_path, trainer):
    rng = random.Random(SEED)
    for fmt in ("torch", "torch_dist"):
        root = _case_dir(tmp_path, fmt)
        pointer = root / "latest_checkpointed_iteration.txt"
        for i in range(50):  # the `latest` pointer
            data = POINTERS[i].encode() if i < len(POINTERS) else mutate_bytes(b"4\n", rng)
            _load_case("latest_checkpointed_iteration.txt", trainer, root, pointer, data, "stale")
        meta = root / "iter_0000004" / "metadata.json"
        for i in range(60):  # metadata.json: bytes, or a JSON tree with a node changed
            if i % 2:
                data = mutate_bytes(meta.read_bytes(), rng)
            else:
                data = json.dumps(mutate_tree(json.loads(meta.read_text()), rng)).encode()
            _load_case("metadata.json", trainer, root, meta, data, "stale")
    root = tmp_path / "torch"
    for name, count in (("model_optim_rng.pt", 120), ("optim_dp_rank_000.pt", 50)):
        file = root / "iter_0000004" / "mp_rank_00" / name
        state = torch.load(file, weights_only=False)
        for i in range(count):  # bytes of the zip, or the state with a node deleted, retyped or reshaped
            if i % 3 == 0:
                data = mutate_bytes(file.read_bytes(), rng)
            else:
                buffer = __import__("io").BytesIO()
                torch.save(mutate_tree(state, rng, tensors=True), buffer)
                data = buffer.getvalue()
            _load_case(f"torch format {name}", trainer, root, file, data, _modes(rng))
    root = tmp_path / "torch_dist"
    index = root / "iter_0000004" / ".metadata"
    metadata = SafeReader(str(index.parent)).read_metadata()
    for i in range(120):  # DCP's index: bytes, or the index with an entry's record changed
        data = mutate_bytes(index.read_bytes(), rng) if i % 3 == 0 else pickle.dumps(_mutate_index(metadata, rng))
        _load_case("DCP .metadata", trainer, root, index, data, _modes(rng))
    distcp = root / "iter_0000004" / "__0_0.distcp"
    for _ in range(40):  # the chunks' bytes (tensors and pickled objects)
        _load_case("DCP .distcp", trainer, root, distcp, mutate_bytes(distcp.read_bytes(), rng), _modes(rng))
    assert TALLY.total("latest_checkpointed_iteration.txt") >= 100 and TALLY.total("DCP .metadata") >= 120


def _mutate_index(metadata, rng: random.Random):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = pickle.loads(pickle.dumps(metadata))
    entries, storage = md.state_dict_metadata, md.storage_data
    key = rng.choice(sorted(entries))
    entry = entries[key]
    kind = rng.randrange(6)
    if kind == 0:
        del entries[key]
    elif kind == 1 and isinstance(entry, TensorStorageMetadata):
        entry.size = torch.Size([rng.choice((0, 1, 3, 2**40)) for _ in range(rng.randrange(4))])
    elif kind == 2 and isinstance(entry, TensorStorageMetadata):
        entry.properties.dtype = rng.choice((torch.int8, torch.bool, torch.float64))
    elif kind == 3 and isinstance(entry, TensorStorageMetadata) and entry.chunks:
        entry.chunks[0].offsets = torch.Size([rng.choice((0, 5, -1)) for _ in entry.chunks[0].offsets])
    elif kind == 4:
        entries[key] = BytesStorageMetadata() if isinstance(entry, TensorStorageMetadata) else random_value(rng)
    else:
        index = rng.choice(list(storage))
        info = storage[index]
        change = rng.randrange(3)
        if change == 0:
            info.offset = rng.choice((-1, 10**9, info.offset + 3))
        elif change == 1:
            info.length = rng.choice((0, -5, 10**9, info.length - 1))
        else:
            info.relative_path = rng.choice(("missing.distcp", "../x", "", "__0_0.distcp/"))
    return md


def test_fuzz_dcp_objects(tmp_path, trainer):
    """The torch_dist checkpoint's pickled objects (train state, layout, loss scaler, RNG, optimizer step, FP8
    recipe and guard), each replaced by a value of another shape, written again with DCP."""
    rng = random.Random(SEED + 1)
    source = ASSETS / "torch_dist" / "iter_0000004"
    metadata = SafeReader(str(source)).read_metadata()
    entries = metadata.state_dict_metadata
    objects = sorted(k for k, v in entries.items() if type(v).__name__ == "BytesStorageMetadata")
    state = {k: None if k in objects else torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()}
    dcp.load(state, storage_reader=SafeReader(str(source)), planner=SafeLoadPlanner(source), no_dist=True)
    state = {k: json.loads(v) if k in ("train_state", "layout") and isinstance(v, str) else v for k, v in state.items()}
    for i in range(40):
        root = tmp_path / f"case{i}"
        folder = root / "iter_0000004"
        folder.mkdir(parents=True)
        (root / "latest_checkpointed_iteration.txt").write_text("4\n")
        changed = dict(state)
        key = rng.choice(objects)
        changed[key] = mutate_tree({"v": state[key]}, rng, tensors=True).get("v")
        dcp.save(changed, checkpoint_id=str(folder), planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
        (folder / "metadata.json").write_text(json.dumps({"format": "torch_dist", "layout": state["layout"]}))
        record_checksums(folder, local_checksums(folder))
        TALLY.run("DCP bytes entries", lambda root=root: trainer.checkpointer.load(str(root)), [str(root)])
        shutil.rmtree(root)


def test_fuzz_report():
    """Runs last in this module: the counts per format."""
    total = sum(TALLY.total(f) for f in TALLY.counts)
    print(f"\nfuzzed checkpoint inputs: {total}")
    for fmt, counts in sorted(TALLY.counts.items()):
        print(f"  {fmt}: {sum(counts.values())} ({counts['refused']} refused, {counts['loaded']} loaded)")
    import os

    if os.environ.get("FUZZ_MESSAGES"):
        for fmt, messages in sorted(TALLY.messages.items()):
            for m in sorted(set(m[:230] for m in messages))[:: max(1, len(set(messages)) // 12)]:
                print(f"    {fmt}: {m}")
