"""Megatron-LM's memory-mapped indexed dataset: a `.bin` of token ids and an `.idx` that says where each sequence is.

The layout is byte-compatible with Megatron-LM, so corpora preprocessed there load here unchanged (and back).
`.idx`, little-endian::

    offset        bytes  field
    0             9      magic b"MMIDIDX\\x00\\x00"
    9             8      uint64 version (1)
    17            1      uint8 dtype code of the .bin (see DTYPE_CODES)
    18            8      uint64 S = number of sequences
    26            8      uint64 D = number of document-index entries (documents + 1)
    34            4*S    int32 sequence lengths, in tokens
    34+4S         8*S    int64 byte offset of each sequence in the .bin
    34+12S        8*D    int64 document indices: 0, then the sequence count at the end of each document

so the file is exactly 34 + 12*S + 8*D bytes. `.bin` holds the sequences back to back, each `length * itemsize`
bytes. A GPT corpus has one sequence per document; corpora split into sentences have several.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

import numpy as np

from .errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


class IndexedDatasetError(DataError):
    """A missing, truncated, corrupt or mismatched .bin/.idx pair; the message names the file and the problem."""


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """uint16 when every id fits with room to spare (vocabulary under 65500, Megatron-LM's rule), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def map_readonly(path: str, dtype: np.dtype | type = np.uint8, count: int = -1, offset: int = 0) -> np.ndarray:
    """`count` items of `dtype` from byte `offset` of the file (all of it by default), memory-mapped read-only,
    holding no open file: np.memmap keeps a descriptor per map, and a blend of hundreds of datasets (an index, a
    .bin and cached arrays each) would run out of them. A ValueError when the file is too short."""
    import torch  # torch's file mapping closes its descriptor once mapped

    size = os.path.getsize(path)
    raw = torch.from_file(path, shared=False, size=size, dtype=torch.uint8).numpy() if size else np.zeros(0, np.uint8)
    raw.flags.writeable = False
    return np.frombuffer(raw, dtype=dtype, count=count, offset=offset)


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


class IndexedDatasetWriter:
    """Writes `{prefix}.bin` and `{prefix}.idx`. Use as a context manager, or call `finalize()`.

    Both files are written under temporary names and renamed into place by `finalize()` (the .idx last), so a
    crashed run never leaves a pair that looks complete.
    """

    def __init__(self, prefix: str, dtype: type[np.number] = np.int32):
        if np.dtype(dtype) not in _CODE_OF:
            raise ValueError(f"unsupported token dtype {np.dtype(dtype)}; use one of {sorted(map(str, _CODE_OF))}")
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self._tmp_suffix = f".tmp{os.getpid()}"
        self._bin = open(data_file_path(prefix) + self._tmp_suffix, "wb")
        self._lengths: list[int] = []
        self._document_indices: list[int] = [0]
        self._finalized = False

    def add_sequence(self, ids: Iterable[int] | np.ndarray) -> None:
        """Append one sequence of token ids (a whole document, for GPT corpora)."""
        array = np.asarray(ids, dtype=self.dtype)
        self._bin.write(array.tobytes(order="C"))
        self._lengths.append(array.size)

    def end_document(self) -> None:
        """Close the current document: the sequences added since the previous call form one document."""
        self._document_indices.append(len(self._lengths))

    def add_document(self, ids: Iterable[int] | np.ndarray) -> None:
        """Append a document made of one sequence."""
        self.add_sequence(ids)
        self.end_document()

    def finalize(self) -> None:
        """Write the .idx and move both files into place."""
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.asarray(self._document_indices, dtype=np.int64)
        idx_tmp = index_file_path(self.prefix) + self._tmp_suffix
        with open(idx_tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(documents)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(documents.astype("<i8").tobytes())
        os.replace(data_file_path(self.prefix) + self._tmp_suffix, data_file_path(self.prefix))
        os.replace(idx_tmp, index_file_path(self.prefix))
        self._finalized = True

    def abort(self) -> None:
        """Drop the partial files."""
        self._bin.close()
        for path in (data_file_path(self.prefix), index_file_path(self.prefix)):
            if os.path.exists(path + self._tmp_suffix):
                os.remove(path + self._tmp_suffix)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Reads a .bin/.idx pair; validates the pair when opened. The .idx is memory-mapped; the .bin too unless
    `mmap` is False (`--no-mmap-bin-files`), then each read is a positioned file read into a fresh array.

    `sequence_lengths[i]` tokens of sequence i start at byte `sequence_pointers[i]` of the .bin;
    `document_indices[d]:document_indices[d+1]` are the sequences of document d.
    """

    def __init__(self, prefix: str, mmap: bool = True):
        self.prefix, self.mmap = prefix, mmap
        self.idx_path, self.bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(
                    f"{path}: {'a directory, not a file' if os.path.isdir(path) else 'no such file'};"
                    " --data-path takes the prefix without .bin/.idx "
                    "(make the pair with tools/preprocess_data.py)"
                )
        self._read_index()
        self._bin: np.ndarray | None = None

    def _read_index(self) -> None:
        path = self.idx_path
        size = os.path.getsize(path)
        if size < HEADER.size:
            raise IndexedDatasetError(f"{path}: truncated ({size} bytes, shorter than the {HEADER.size}-byte header)")
        index = map_readonly(path)
        magic, version, code, count, doc_count = HEADER.unpack(index[: HEADER.size].tobytes())
        if magic != MAGIC:
            raise IndexedDatasetError(f"{path}: not a Megatron indexed-dataset index (magic {magic!r}, want {MAGIC!r})")
        if version != VERSION:
            raise IndexedDatasetError(f"{path}: unsupported index version {version} (this reader knows {VERSION})")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        expected = HEADER.size + 12 * count + 8 * doc_count
        if size != expected:
            raise IndexedDatasetError(
                f"{path}: {'truncated' if size < expected else 'trailing bytes'}: header promises {count} sequences"
                f" and {doc_count} document indices ({expected} bytes) but the file has {size} bytes"
            )
        self.dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
        offset = HEADER.size
        self.sequence_lengths = np.frombuffer(index, dtype="<i4", count=count, offset=offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(index, dtype="<i8", count=count, offset=offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(index, dtype="<i8", count=doc_count, offset=offset)
        self._validate(count, doc_count)

    def _validate(self, count: int, doc_count: int) -> None:
        """O(S) vectorized consistency checks, in chunks so memory stays bounded on billion-sequence corpora."""
        path, itemsize = self.idx_path, self.dtype.itemsize
        docs = self.document_indices
        if doc_count < 1 or docs[0] != 0 or docs[-1] != count:
            raise IndexedDatasetError(
                f"{path}: corrupt document indices (must run from 0 to the sequence count {count})"
            )
        bin_size = os.path.getsize(self.bin_path)
        expected_bin = 0 if count == 0 else int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
        chunk = 1 << 22
        for start in range(0, max(count, doc_count), chunk):
            lengths = self.sequence_lengths[start : start + chunk + 1]
            pointers = self.sequence_pointers[start : start + chunk + 1]
            if (lengths < 0).any():
                raise IndexedDatasetError(f"{path}: corrupt index (negative sequence length)")
            first_wrong = start == 0 and len(pointers) > 0 and pointers[0] != 0
            if first_wrong or (np.diff(pointers) != lengths[:-1].astype(np.int64) * itemsize).any():
                raise IndexedDatasetError(f"{path}: corrupt index (sequence offsets disagree with sequence lengths)")
            if (np.diff(docs[start : start + chunk + 1]) < 0).any():
                raise IndexedDatasetError(f"{path}: corrupt document indices (not increasing)")
        if bin_size != expected_bin:
            raise IndexedDatasetError(
                f"{self.bin_path}: {bin_size} bytes but {path} describes {expected_bin} bytes of {self.dtype.name}"
                " tokens: the pair is truncated or mismatched (rerun tools/preprocess_data.py)"
            )

    @property
    def bin(self) -> np.ndarray:
        """The whole .bin as a flat token array, memory-mapped on first use (so forked workers map their own)
        whatever `mmap` says."""
        if self._bin is None:
            self._bin = map_readonly(self.bin_path, self.dtype)
        return self._bin

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_bin"] = None  # never pickle the mapped data; the receiving process maps the file itself
        return state

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index` (to its end when length is None), a read-only view."""
        seq_length = int(self.sequence_lengths[index])
        if length is None:
            length = seq_length - offset
        if not (0 <= offset and offset + length <= seq_length):
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {index} of length {seq_length}")
        if not self.mmap:
            return self._read(int(self.sequence_pointers[index]) + offset * self.dtype.itemsize, length)
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self.bin[start : start + length]

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        """`count` tokens from `byte_offset` of the .bin by a file read (opened per call: safe in forked workers)."""
        out = np.empty(count, dtype=self.dtype)
        with open(self.bin_path, "rb", buffering=0) as f:
            f.seek(byte_offset)
            got = f.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:
            raise IndexedDatasetError(f"{self.bin_path}: short read at byte {byte_offset} (the file changed?)")
        return out

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)
