"""Memory-mapped datasets for pre-tokenised text and pre-processed tensors: no decoding, no per-sample files.

Token sequences go to one flat ``PREFIX.bin`` (the smallest unsigned dtype that holds the vocabulary) plus
``PREFIX.idx.npy`` (int64 offsets); tensors go to one ``.npy`` per field. Reading maps the files with
``np.memmap`` / ``np.load(mmap_mode="r")``: the OS pages data in on demand and shares it between DataLoader workers,
so start-up is instant and memory does not grow with the dataset. Maps are opened lazily in each process (they are
not pickled into workers). Files are written under a temporary name and renamed when complete, so an interrupted
write never leaves a truncated dataset that looks whole.

Usage::

    write_token_sequences(tokenizer_output_ids, "data/train")           # -> data/train.bin, data/train.idx.npy
    dataset = MemmapTokenDataset("data/train")                          # dataset[i] -> {"input_ids": LongTensor}
    write_tensors({"pixel_values": images, "labels": labels}, "data/cached")   # one .npy per field
    cached = MemmapTensorDataset("data/cached")                         # cached[i] -> {"pixel_values": ..., ...}
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from vlmfast.common.safe_files import open_for_writing

TOKEN_DTYPES = (np.uint8, np.uint16, np.uint32, np.int64)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds ids 0 .. vocab_size - 1."""
    for dtype in TOKEN_DTYPES:
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size {vocab_size} does not fit in int64")


def write_token_sequences(
    sequences: Iterable[Sequence[int]], prefix: str | Path, vocab_size: int | None = None
) -> tuple[Path, Path]:
    """Stream token sequences to PREFIX.bin + PREFIX.idx.npy. Returns both paths.

    Without `vocab_size`, ids are stored as uint32; a larger id is an error that asks for `vocab_size`.
    """
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size) if vocab_size else np.dtype(np.uint32)
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx.npy")
    offsets = [0]
    tmp_bin = bin_path.with_name(bin_path.name + ".tmp")
    try:
        with open_for_writing(tmp_bin, "wb", what="token file") as out:  # never through a link
            for index, sequence in enumerate(sequences):
                ids = _checked_ids(index, sequence, dtype)
                out.write(ids.astype(dtype).tobytes())
                offsets.append(offsets[-1] + ids.size)
    except BaseException:
        tmp_bin.unlink(missing_ok=True)  # nothing half-written is left behind; an existing dataset is untouched
        raise
    _save_npy_atomic(idx_path, np.asarray(offsets, dtype=np.int64))
    os.replace(tmp_bin, bin_path)  # a link at bin_path is replaced itself, never followed
    return bin_path, idx_path


def _checked_ids(index: int, sequence: Sequence[int], dtype: np.dtype) -> np.ndarray:
    ids = np.asarray(sequence, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"sequence {index} has shape {ids.shape}: expected a flat list of token ids")
    limit = np.iinfo(dtype).max
    bad = ids[(ids < 0) | (ids > limit)]
    if bad.size:
        raise ValueError(f"sequence {index} has token id {int(bad[0])} outside 0..{limit} ({dtype.name}): "
                         "pass vocab_size to write_token_sequences (ids must be >= 0)")
    return ids


def write_tensors(fields: Mapping[str, Any], directory: str | Path) -> list[Path]:
    """Save each field (tensor or array, same first dimension) as DIRECTORY/NAME.npy for MemmapTensorDataset."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {name: value.numpy(force=True) if isinstance(value, torch.Tensor) else np.asarray(value)
              for name, value in fields.items()}
    lengths = {name: len(array) for name, array in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"fields have different numbers of samples: {lengths}; they must share the first dimension")
    paths = []
    for name, array in arrays.items():
        paths.append(directory / f"{name}.npy")
        _save_npy_atomic(paths[-1], array)
    return paths


class MemmapTokenDataset(Dataset[dict[str, torch.Tensor]]):
    """Token sequences written by :func:`write_token_sequences`; ``dataset[i]`` -> {"input_ids": LongTensor}."""

    def __init__(self, prefix: str | Path, key: str = "input_ids") -> None:
        self.prefix = Path(prefix)
        self.key = key
        self.bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx.npy")
        for path in (self.bin_path, idx_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found: write it with vlmfast.data.mmap.write_token_sequences")
        self.offsets = np.load(idx_path)
        self.dtype = _dtype_from_size(self.bin_path, int(self.offsets[-1]))
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._tokens is None:  # opened in the process that reads (each DataLoader worker maps its own)
            self._tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r")
        start, stop = self.offsets[index], self.offsets[index + 1]
        return {self.key: torch.from_numpy(self._tokens[start:stop].astype(np.int64))}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}


class MemmapTensorDataset(Dataset[dict[str, torch.Tensor]]):
    """Fields written by :func:`write_tensors`; ``dataset[i]`` -> {field: tensor of sample i}, read lazily."""

    def __init__(self, directory: str | Path, fields: Sequence[str] | None = None) -> None:
        self.directory = Path(directory)
        names = fields or sorted(p.stem for p in self.directory.glob("*.npy"))
        if not names:
            raise FileNotFoundError(f"no .npy files in {self.directory}: write them with "
                                    "vlmfast.data.mmap.write_tensors")
        self.paths = {name: self.directory / f"{name}.npy" for name in names}
        missing = [str(p) for p in self.paths.values() if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"missing field files: {', '.join(missing)}")
        lengths = {name: len(np.load(path, mmap_mode="r")) for name, path in self.paths.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"fields in {self.directory} have different lengths {lengths}: write them together")
        self.length = next(iter(lengths.values()))
        self._arrays: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._arrays is None:
            self._arrays = {name: np.load(path, mmap_mode="r") for name, path in self.paths.items()}
        return {name: torch.from_numpy(np.array(array[index])) for name, array in self._arrays.items()}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    with open_for_writing(tmp, "wb", what="token index") as f:  # never through a link
        np.save(f, array)
    os.replace(tmp, path)  # a link at `path` is replaced itself, never followed


def _dtype_from_size(bin_path: Path, num_tokens: int) -> np.dtype:
    """The token dtype follows from the file size (tokens x bytes per token); anything else means a broken write."""
    size = bin_path.stat().st_size
    by_itemsize = {np.dtype(d).itemsize: np.dtype(d) for d in TOKEN_DTYPES}
    if num_tokens == 0 and size == 0:
        return np.dtype(np.uint32)
    if num_tokens == 0 or size % num_tokens or size // num_tokens not in by_itemsize:
        raise ValueError(f"{bin_path} has {size} bytes, which does not match the {num_tokens} tokens of its index: "
                         "the file is incomplete or from another write; write it again")
    return by_itemsize[size // num_tokens]
