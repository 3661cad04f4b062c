"""Pickles that are data-only yet hostile: numpy objects whose bytes numpy would read as pointers (a crash), and tiny
files that ask for huge work (a range, a bytearray, shared references that expand when printed). Each is refused in
one line naming the file and the limit, in time; the plain numpy data real files hold still loads."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from megatron.checkpoint.plain_data import CheckedArray
from megatron.checkpoint.safe_load import DcpIndexUnpickler, SafeReader, load_foreign, load_own, unpickle_data
from megatron.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
_numpy = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core


class Reduce:
    """Pickles as `fn(*args)` with `state` for BUILD: a crafted file, without the class the real object has."""

    def __init__(self, fn, args, state=None):
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def object_flagged_array(flags: int = 0x7D, code: str = "O") -> Reduce:
    """An array whose dtype claims to hold objects but whose state is raw bytes: numpy reads 0x4141... as a
    PyObject pointer when an element is touched."""
    dtype = Reduce(np.dtype, (code, False, True), (3, "|", None, None, None, -1, -1, flags))
    return Reduce(_numpy.multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, (2,), dtype, False, b"\x41" * 16))


def crafted_index(size) -> bytes:
    """DCP's .metadata with one tensor entry whose `size` is `size`."""
    entry = dcp_metadata.TensorStorageMetadata(
        dcp_metadata.TensorProperties(dtype=torch.float32), torch.Size([2]), [dcp_metadata.ChunkStorageMetadata(
            torch.Size([0]), torch.Size([2]))])  # fmt: skip
    entry.size = size
    return pickle.dumps(dcp_metadata.Metadata({"w": entry}, storage_data={}), protocol=2)


def test_an_object_flagged_numpy_array_in_a_dcp_index_is_refused_not_a_crash(tmp_path):
    """In a child process, so that a regression crashes the child, not the test run."""
    (tmp_path / ".metadata").write_bytes(crafted_index(object_flagged_array()))
    script = textwrap.dedent(f"""
        from megatron.checkpoint.safe_load import SafeReader
        try:
            metadata = SafeReader({str(tmp_path)!r}).read_metadata()
            print("loaded", [list(e.size) for e in metadata.state_dict_metadata.values()])
        except ValueError as exc:
            print("refused:", exc)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert run.returncode == 0, f"the loader died (signal {-run.returncode}): {run.stderr[-2000:]}"
    assert run.stdout.startswith("refused:") and str(tmp_path) in run.stdout and "numpy dtype 'O'" in run.stdout


@pytest.mark.parametrize(
    "hostile",
    [
        object_flagged_array(),  # an object dtype whose state drops the flag that makes numpy want a list
        object_flagged_array(0x01, "V8"),  # raw bytes under an object-flagged void dtype
        object_flagged_array(0, "O"),  # a plain object array (its state a list of whatever the pickle holds)
        Reduce(np.dtype, ("i4,O", False, True)),  # a structured dtype with an object field
        Reduce(np.dtype, ("(2,)i4", False, True)),  # a subarray dtype
        Reduce(np.dtype, ("u4", False, True), (3, "<", None, ("a",), {"a": 1}, 4, 4, 0)),  # fields through state
        Reduce(_numpy.multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, (9,), np.dtype("u4"), False, b"\0" * 8)),
        Reduce(_numpy.multiarray.scalar, (np.dtype("f8"), b"\x00")),  # fewer bytes than the dtype's
    ],
    ids=["O-unflagged", "V8-flagged", "object-array", "structured", "subarray", "fields", "short-data", "scalar"],
)
def test_numpy_objects_other_than_plain_arrays_never_exist(hostile):
    data = pickle.dumps(hostile, protocol=2)
    with pytest.raises(ValueError):
        unpickle_data(data)
    buffer = io.BytesIO()
    torch.save({"rng": hostile}, buffer)
    buffer.seek(0)
    with pytest.raises(UserError, match=r"^entry rng is not loaded: it holds .*numpy") as info:
        load_own(buffer, "entry rng")  # torch's weights-only path, with numpy's RNG array allowed
    assert "\n" not in str(info.value)


def test_plain_numpy_data_still_loads_and_pickles_again_as_numpy():
    state = np.random.RandomState(7).get_state()
    values = {"rng": state, "scalar": np.float64(1.5), "flag": np.bool_(True), "big": np.arange(6, dtype=">i8")}
    for loaded in (unpickle_data(pickle.dumps(values, protocol=2)), unpickle_data(pickle.dumps(values))):
        key = loaded["rng"][1]
        assert isinstance(key, CheckedArray) and key.dtype == np.uint32 and np.array_equal(key, state[1])
        assert loaded["scalar"] == 1.5 and type(loaded["scalar"]) is np.float64 and loaded["flag"] is np.True_
        assert np.array_equal(loaded["big"], values["big"])  # in native byte order, as numpy unpickles it
        rng = np.random.RandomState()
        rng.set_state(loaded["rng"])
        assert rng.randint(1000) == np.random.RandomState(7).randint(1000)
        assert type(pickle.loads(pickle.dumps(key))) is np.ndarray  # saved again, it is plain numpy's
    buffer = io.BytesIO()
    torch.save({"np_rng_state": state}, buffer)  # this project's checkpoints before RNG states were lists
    buffer.seek(0)
    assert np.array_equal(load_own(buffer, "old rng")["np_rng_state"][1], state[1])


def _chain(levels: int) -> list:
    """A list holding the previous one twice, `levels` times: a few bytes per level, 2**levels when printed."""
    node: list = []
    for _ in range(levels):
        node = [node, node]
    return node


TINY = {
    "range": (Reduce(range, (10**12,)), "a range of 1,000,000,000,000 elements, over the limit"),
    "bytearray": (Reduce(bytearray, (3 * 10**9,)), "a bytearray of int 3000000000"),
    "set of a range": (Reduce(set, (Reduce(range, (10**10,)),)), "a range of 10,000,000,000 elements"),
    "torch.Size of a range": (Reduce(torch.Size, (Reduce(range, (10**8,)),)), "a range of 100,000,000 elements"),
    "shared references": (_chain(40), r"expands to 2,199,023,255,55\d nodes through shared references"),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_pickles_asking_for_huge_work_are_refused_in_one_line(tmp_path, name):
    hostile, message = TINY[name]
    data = pickle.dumps({"train_state": hostile}, protocol=2)
    assert len(data) < 1000, len(data)
    start = time.perf_counter()
    with pytest.raises((ValueError, UserError), match=message):
        unpickle_data(data)
    file = tmp_path / "model_optim_rng.pt"
    torch.save({"args": hostile}, file)
    with pytest.raises(UserError, match=rf"^{file} is not loaded: it .*{message}") as info:
        load_foreign(file, str(file))
    assert "\n" not in str(info.value)
    assert time.perf_counter() - start < 5


def test_deep_nesting_is_refused_before_anything_recurses(tmp_path):
    deep = b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b"."  # 5,000 empty lists, each appended to the one before
    with pytest.raises(UserError, match="nests objects over 200 deep"):
        unpickle_data(deep)
    (tmp_path / ".metadata").write_bytes(deep)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/.metadata is not loaded: it nests objects over 200 deep"):
        SafeReader(str(tmp_path)).read_metadata()


def test_a_dcp_index_whose_records_disagree_is_damaged(tmp_path):
    for size in (torch.Size([2, 3]), [2], torch.Size([-1])):  # chunks of another rank, not a Size, a negative size
        (tmp_path / ".metadata").write_bytes(crafted_index(size))
        with pytest.raises(ValueError, match=r"is damaged: its entries are not DCP's"):
            SafeReader(str(tmp_path)).read_metadata()
    assert DcpIndexUnpickler(io.BytesIO(crafted_index(torch.Size([2])))).load().state_dict_metadata["w"].size == (2,)
