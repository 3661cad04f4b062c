"""A checkpoint is data, never code: pickles whose loading would run a command (each creates a marker file when
unpickled the old way) are refused in one line by every loader: the torch format, its distributed-optimizer rank
files, DCP's index and bytes entries, Transformer Engine's extra state, and the converter's native / mcore / hf
loaders. --trust-checkpoint (MEGATRON_TRUST_CHECKPOINT=1) loads a trusted file the old way."""

from __future__ import annotations

import argparse
import builtins
import enum
import functools
import io
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import pretrain_gpt
from megatron.checkpoint.integrity import local_checksums, record_checksums
from megatron.checkpoint.safe_load import TRUST_ENV
from megatron.config import parse_args
from megatron.errors import UserError
from megatron.training import Trainer
from tests.unit.ckpt_files import tree_digest

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets" / "old_checkpoints"
FLAGS = json.loads((ASSETS / "expected.json").read_text())["flags"]
sys.path.insert(0, str(ROOT / "tools" / "checkpoint"))
import convert as tool  # noqa: E402


class _Call:
    """Pickles as `fn(*args)`: what a crafted checkpoint's __reduce__ does."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)

    def __call__(self, *args):  # pickle wants the callable slot callable
        return None


def payloads(marker: Path) -> dict[str, object]:
    code = f"__import__('os').system('touch {marker}')"
    return {
        "os.system": _Call(os.system, f"touch {marker}"),
        "subprocess.call": _Call(subprocess.call, ["touch", str(marker)]),
        "builtins.eval": _Call(builtins.eval, code),
        "builtins.exec": _Call(builtins.exec, code),
        "functools.partial": _Call(functools.partial(os.system, f"touch {marker}")),
        "builtins.getattr": _Call(_Call(getattr, pathlib.Path, "touch"), pathlib.Path(marker)),
    }


PAYLOADS = list(payloads(Path("m")))
REFUSED = {  # what a refusal names: the first global of the payload outside the allowlist
    "os.system": ["posix.system", "os.system"],
    "subprocess.call": ["subprocess.call"],
    "builtins.eval": ["builtins.eval"],
    "builtins.exec": ["builtins.exec"],
    "functools.partial": ["functools.partial"],
    "builtins.getattr": ["builtins.getattr", "pathlib.Path"],
}


def test_every_payload_runs_its_command_when_unpickled_the_old_way(tmp_path):
    """The crafted pickles are live: plain pickle runs them (so the refusals below are what stops them)."""
    for name, payload in payloads(tmp_path / "m").items():
        pickle.loads(pickle.dumps(payload))
        assert (tmp_path / "m").exists(), name
        (tmp_path / "m").unlink()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    empty = tmp_path_factory.mktemp("empty")
    return Trainer(parse_args(f"{FLAGS} --train-iters 6 --load {empty}".split(), world_size=1))


def _rechecksum(folder: Path, keep: bool) -> None:
    """The checksums an attacker records for the crafted files (`keep`), or none (a checkpoint "predating" them)."""
    if keep:
        record_checksums(folder, local_checksums(folder))
    else:
        info = json.loads((folder / "metadata.json").read_text())
        info.pop("checksums", None)
        (folder / "metadata.json").write_text(json.dumps(info))


def _torch_file(root: Path, name: str, key: str, payload) -> None:
    file = root / "iter_0000004" / "mp_rank_00" / name
    state = torch.load(file, weights_only=False)
    if key == "extra_state":  # Transformer Engine's FP8 state: a pickle in a uint8 tensor
        data = bytearray(pickle.dumps({"recipe": payload}))
        state["model"]["decoder.layers.0.mlp.linear_fc1._extra_state"] = torch.frombuffer(data, dtype=torch.uint8)
    else:
        state[key] = payload
    torch.save(state, file)


def _dcp_object(root: Path, payload) -> None:
    folder = root / "iter_0000004"
    shutil.rmtree(folder)
    folder.mkdir()
    dcp.save({"train_state": payload, "layout": "{}"}, checkpoint_id=str(folder), no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({"format": "torch_dist", "layout": {"tp": 1, "pp": 1, "dp": 1}}))


CRAFTERS = {
    "torch format": ("torch", lambda root, p: _torch_file(root, "model_optim_rng.pt", "rng", p)),
    "rank file": ("torch", lambda root, p: _torch_file(root, "optim_dp_rank_000.pt", "optimizer", p)),
    "TE extra state": ("torch", lambda root, p: _torch_file(root, "model_optim_rng.pt", "extra_state", p)),
    "DCP bytes entry": ("torch_dist", _dcp_object),
    "DCP .metadata": ("torch_dist", lambda root, p: (root / "iter_0000004" / ".metadata").write_bytes(pickle.dumps(p))),
}


def _crafted(tmp_path: Path, loader: str, payload, checksums: bool = True) -> Path:
    fmt, craft = CRAFTERS[loader]
    root = tmp_path / "ckpt"
    shutil.copytree(ASSETS / fmt, root)
    craft(root, payload)
    _rechecksum(root / "iter_0000004", checksums)
    return root


def _refused_in_one_line(run, names: list[str]) -> str:
    with pytest.raises(UserError) as info:
        run()
    message = str(info.value)
    assert "\n" not in message and any(n in message for n in names), message
    return message


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("loader", list(CRAFTERS))
def test_pretrain_loaders_refuse_code(tmp_path, trainer, loader, payload, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / "marker"
    for checksums in (True, False):  # recorded by the attacker, or none (loaded through the same safe path)
        root = _crafted(tmp_path / str(checksums), loader, payloads(marker)[payload], checksums)
        before = tree_digest(root)
        message = _refused_in_one_line(lambda r=root: trainer.checkpointer.load(str(r)), [str(root)])
        assert not marker.exists(), f"{loader}: the crafted checkpoint ran its command"
        assert "not plain data" in message or "not loaded" in message, message
        assert tree_digest(root) == before


def _mlm_legacy(root: Path, payload) -> Path:
    shard = root / "iter_0000050" / "mp_rank_00"
    shard.mkdir(parents=True)
    args = argparse.Namespace(num_layers=1, hidden_size=16, num_attention_heads=2, rerun_state=payload)
    torch.save({"args": args, "iteration": 50, "model": {"embedding.word_embeddings.weight": torch.zeros(4, 16)}},
               shard / "model_optim_rng.pt")  # fmt: skip
    (root / "latest_checkpointed_iteration.txt").write_text("50")
    return root


def _mlm_dist(root: Path, payload, where: str) -> Path:
    folder = root / "iter_0000050"
    folder.mkdir(parents=True)
    args = argparse.Namespace(num_layers=1, hidden_size=16, num_attention_heads=2)
    dcp.save({"embedding.word_embeddings.weight": torch.zeros(4, 16)}, checkpoint_id=str(folder), no_dist=True)
    if where == "common.pt":
        torch.save({"args": args, "rng_state": [payload]}, folder / "common.pt")
    else:
        torch.save({"args": args}, folder / "common.pt")
        (folder / ".metadata").write_bytes(pickle.dumps(payload))
    (root / "latest_checkpointed_iteration.txt").write_text("50")
    return root


def _hf_bin(root: Path, payload) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    torch.save({"model.embed_tokens.weight": torch.zeros(4, 16), "lm_head.weight": payload}, root / "pytorch_model.bin")
    return root


CONVERTER_CRAFTERS = {
    "native torch": ("native", lambda tmp, p: _crafted(tmp, "torch format", p)),
    "native torch_dist": ("native", lambda tmp, p: _crafted(tmp, "DCP bytes entry", p)),
    "native DCP .metadata": ("native", lambda tmp, p: _crafted(tmp, "DCP .metadata", p)),
    "mcore legacy": ("mcore", lambda tmp, p: _mlm_legacy(tmp / "mlm", p)),
    "mcore torch_dist common.pt": ("mcore", lambda tmp, p: _mlm_dist(tmp / "mlm", p, "common.pt")),
    "mcore torch_dist .metadata": ("mcore", lambda tmp, p: _mlm_dist(tmp / "mlm", p, ".metadata")),
    "hf pytorch_model.bin": ("hf", lambda tmp, p: _hf_bin(tmp / "hf", p)),
}


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("loader", list(CONVERTER_CRAFTERS))
def test_converter_loaders_refuse_code(tmp_path, loader, payload, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / "marker"
    kind, craft = CONVERTER_CRAFTERS[loader]
    source, out = craft(tmp_path, payloads(marker)[payload]), tmp_path / "out"
    argv = f"--loader {kind} --saver native --load-dir {source} --save-dir {out}".split()
    message = _refused_in_one_line(lambda: tool.convert(tool.parse(argv), log=lambda *_: None), [str(source)])
    assert not marker.exists(), f"{loader}: the crafted checkpoint ran its command"
    assert "not plain data" in message and any(name in message for name in REFUSED[payload]), message
    assert not out.exists()


def test_megatron_lm_classes_come_back_as_data_stand_ins(monkeypatch):
    """Megatron-LM's classes (not installed here) come back as stand-ins holding their data, never imported."""
    from megatron.checkpoint.safe_load import ForeignUnpickler, StandIn

    module = types.ModuleType("megatron.core.rerun_state_machine")

    class RerunMode(enum.Enum):
        DISABLED = "disabled"

    RerunMode.__module__, RerunMode.__qualname__, module.RerunMode = module.__name__, "RerunMode", RerunMode
    monkeypatch.setitem(sys.modules, module.__name__, module)
    data = pickle.dumps({"mode": RerunMode.DISABLED, "args": argparse.Namespace(num_layers=2)})
    monkeypatch.delitem(sys.modules, module.__name__)
    state = ForeignUnpickler(io.BytesIO(data)).load()
    assert isinstance(state["mode"], StandIn) and state["mode"].args == ("disabled",)
    assert state["args"].num_layers == 2 and module.__name__ not in sys.modules


def test_the_opt_in_loads_a_trusted_file_the_old_way(tmp_path, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / "marker"
    root = _crafted(tmp_path, "torch format", payloads(marker)["os.system"])
    argv = f"{FLAGS} --train-iters 4 --ckpt-format torch --load {root} --no-load-rng".split()
    assert pretrain_gpt.main(argv + ["--trust-checkpoint"]) == 0
    assert os.environ[TRUST_ENV] == "1" and marker.exists()  # trusted: loaded as before, code included


def _one_line_exit_2(argv: list[str]) -> str:
    run = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr[-2000:]
    return lines[0]


def test_real_runs_exit_2_with_one_line(tmp_path, monkeypatch):
    """The processes themselves: pretrain_gpt.py on a crafted checkpoint and on a malformed pointer, convert.py on a
    crafted Megatron-LM checkpoint; each exits 2 with one line on stderr and runs nothing."""
    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / "marker"
    root = _crafted(tmp_path / "a", "torch format", payloads(marker)["os.system"], checksums=False)
    damaged = _crafted(tmp_path / "b", "torch format", None)
    (damaged / "latest_checkpointed_iteration.txt").write_bytes(b"4\xff")
    mlm = _mlm_legacy(tmp_path / "mlm", payloads(marker)["subprocess.call"])
    convert = ["tools/checkpoint/convert.py", "--loader", "mcore", "--saver", "native", "--load-dir", str(mlm)]
    runs = [
        ["pretrain_gpt.py", *FLAGS.split(), "--train-iters", "6", "--load", str(root)],
        ["pretrain_gpt.py", *FLAGS.split(), "--train-iters", "6", "--load", str(damaged)],
        [*convert, "--save-dir", str(tmp_path / "out")],
    ]
    # Three independent processes, each mostly a single-threaded Python start-up: run side by side on the cores
    with ThreadPoolExecutor(len(runs)) as pool:
        crafted, pointer, converted = pool.map(_one_line_exit_2, runs)
    assert str(root) in crafted and "posix.system" in crafted and "--trust-checkpoint" in crafted
    assert "latest_checkpointed_iteration.txt is corrupt" in pointer
    assert "subprocess.call" in converted and not (tmp_path / "out").exists()
    assert not marker.exists()
