"""The .bin/.idx format: a byte-by-byte index from the documented layout, write/read round trips, and every
bad-file error naming its file and problem."""

import os
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    optimal_dtype,
)
from megatron.errors import UserError

# Two documents: the first of two sequences (a sentence-split document), the second of one.
SEQUENCES = [[5, 6, 7], [65000, 1], [42, 43, 44, 45]]
DOCUMENTS = [[0, 1], [2]]


def layout_bytes(sequences, dtype_code, itemsize):
    """The .idx of the issue's layout, assembled field by field (no code shared with the writer)."""
    lengths = [len(s) for s in sequences]
    offsets = [sum(lengths[:i]) * itemsize for i in range(len(sequences))]
    doc_indices = [0, 2, 3]
    out = b"MMIDIDX\x00\x00"
    out += struct.pack("<Q", 1)
    out += struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(sequences))
    out += struct.pack("<Q", len(doc_indices))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    out += b"".join(struct.pack("<q", o) for o in offsets)
    out += b"".join(struct.pack("<q", d) for d in doc_indices)
    return out


def write_example(prefix, dtype=np.uint16):
    with IndexedDatasetWriter(str(prefix), dtype) as writer:
        for doc in DOCUMENTS:
            for i in doc:
                writer.add_sequence(SEQUENCES[i])
            writer.end_document()


def test_layout_bytes_are_read_and_written_exactly(tmp_path):
    expected_idx = layout_bytes(SEQUENCES, dtype_code=8, itemsize=2)
    expected_bin = b"".join(struct.pack("<H", t) for s in SEQUENCES for t in s)
    (tmp_path / "hand.idx").write_bytes(expected_idx)
    (tmp_path / "hand.bin").write_bytes(expected_bin)

    ds = IndexedDataset(str(tmp_path / "hand"))
    assert ds.dtype == np.uint16 and len(ds) == 3 and ds.num_documents == 2 and ds.num_tokens == 9
    assert ds.sequence_lengths.tolist() == [3, 2, 4]
    assert ds.sequence_pointers.tolist() == [0, 6, 10]
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert [ds[i].tolist() for i in range(3)] == SEQUENCES
    assert ds.get(2, offset=1, length=2).tolist() == [43, 44]

    write_example(tmp_path / "written")
    assert (tmp_path / "written.idx").read_bytes() == expected_idx
    assert (tmp_path / "written.bin").read_bytes() == expected_bin


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = DTYPE_CODES[code]
    rng = np.random.default_rng(code)
    docs = [rng.integers(0, 100, size=n).astype(dtype) for n in (0, 1, 17, 300)]
    with IndexedDatasetWriter(str(tmp_path / "d"), dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    ds = IndexedDataset(str(tmp_path / "d"))
    assert ds.dtype == np.dtype(dtype) and ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    assert (tmp_path / "d.idx").read_bytes()[17] == code


def test_optimal_dtype_follows_megatron():
    assert optimal_dtype(50257) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(128256) == np.int32


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "d"), np.int32) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("crash mid-way")
    assert os.listdir(tmp_path) == []


def corrupt(path, offset=None, data=None, truncate=None, append=None):
    raw = bytearray(path.read_bytes())
    if data is not None:
        raw[offset : offset + len(data)] = data
    if truncate is not None:
        raw = raw[:truncate]
    if append is not None:
        raw += append
    path.write_bytes(bytes(raw))


CASES = {
    "bad magic": (".idx", dict(offset=0, data=b"NOTMAGIC!"), r"d\.idx: not a Megatron indexed-dataset index"),
    "bad version": (".idx", dict(offset=9, data=struct.pack("<Q", 2)), r"d\.idx: unsupported index version 2"),
    "bad dtype": (".idx", dict(offset=17, data=b"\x09"), r"d\.idx: unknown dtype code 9"),
    "short header": (".idx", dict(truncate=20), r"d\.idx: truncated \(20 bytes"),
    "truncated idx": (".idx", dict(truncate=60), r"d\.idx: truncated: header promises 3 sequences"),
    "trailing idx": (".idx", dict(append=b"\x00" * 8), r"d\.idx: trailing bytes"),
    "truncated bin": (".bin", dict(truncate=10), r"d\.bin: 10 bytes but .*d\.idx describes 18 bytes of uint16"),
    "longer bin": (".bin", dict(append=b"\x00\x00"), r"d\.bin: 20 bytes .* truncated or mismatched"),
    "bad offsets": (".idx", dict(offset=34 + 12 + 8, data=struct.pack("<q", 4)), r"d\.idx: corrupt index \(sequence"),
    "bad documents": (".idx", dict(offset=34 + 36 + 16, data=struct.pack("<q", 2)), r"d\.idx: corrupt document"),
    "negative length": (".idx", dict(offset=34, data=struct.pack("<i", -3)), r"d\.idx: corrupt index \(negative"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_files_fail_naming_file_and_problem(tmp_path, case):
    suffix, change, message = CASES[case]
    write_example(tmp_path / "d")
    corrupt(tmp_path / f"d{suffix}", **change)
    with pytest.raises(IndexedDatasetError, match=message) as info:
        IndexedDataset(str(tmp_path / "d"))
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)


def test_missing_files_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(IndexedDatasetError, match=r"nothere\.idx: no such file; --data-path takes the prefix"):
        IndexedDataset(str(tmp_path / "nothere"))
    write_example(tmp_path / "d")
    os.remove(tmp_path / "d.bin")
    with pytest.raises(IndexedDatasetError, match=r"d\.bin: no such file"):
        IndexedDataset(str(tmp_path / "d"))


def test_pair_from_another_dataset_is_a_mismatch(tmp_path):
    write_example(tmp_path / "a")
    with IndexedDatasetWriter(str(tmp_path / "b"), np.uint16) as writer:
        writer.add_document(range(50))
    os.replace(tmp_path / "b.bin", tmp_path / "a.bin")
    with pytest.raises(IndexedDatasetError, match=r"a\.bin: 100 bytes but .*a\.idx describes 18 bytes"):
        IndexedDataset(str(tmp_path / "a"))
