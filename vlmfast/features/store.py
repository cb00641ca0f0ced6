"""A memory-mapped, append-only store of per-image feature tensors, shared by every process that opens its folder.

Layout of a store folder (the cache makes one per fingerprint of the tower's weights, dtype and inputs)::

    meta.json                          what the entries were computed with (written once, for people)
    w0.lock  w0.v2.idx  w0-0.bin ...   writer 0: its lock, its index (72-byte records), its data segments
    w1.lock  w1.v2.idx  w1-0.bin ...   writer 1: another rank of the run, or another run at the same time

The index's name carries the record format (``v2``: records with a checksum): a store written by an older version
holds no ``.v2.idx`` file, so its entries are never read (the cache's own folder names change with the format too).

A process that writes claims a writer slot with an exclusive ``flock`` on ``wN.lock`` (released when the process
ends, even on SIGKILL), so no two processes ever write the same files, and every process reads every writer's
entries: under DDP each rank adds its own entries and finds those of the others (a sample a rank cached in epoch 1
is usually on another rank in epoch 2, since the sampler reshuffles). ``read_only=True`` opens a store prepared
earlier without writing to it (one store shared read-only by all ranks or runs).

Crash safety: an entry's bytes are written into its segment before its record is appended to the index, and a
reader only takes whole records, so a reader never sees a half-written entry; a writer killed mid-entry leaves
unreferenced bytes that its slot's next writer overwrites. Segments are sparse files mapped with ``mmap``: a read
is a copy out of the page cache, and only written bytes take disk space. The disk space of each entry is reserved
(``posix_fallocate`` on its byte range, else writes of zeros) before its bytes are written through the map: a full
disk is an ``OSError`` from :meth:`FeatureStore.put`, never a SIGBUS from a store into a page that has no block.

Verification: each record holds a checksum of its entry's bytes, checked on every read (on the copy, so what is
checked is what is used); a mismatch raises :class:`CorruptEntryError`, and :meth:`FeatureStore.put` with
``replace=True`` stores the recomputed entry under the same key (a later record of a key wins over an earlier one).
The checksum is xxHash's XXH3-64 when the ``xxhash`` package is installed (about 0.12 ms per MiB on one core), else
zlib's CRC-32 (about 0.6 ms per MiB, ~2.6x the copy itself); the record says which, and a process without the
writer's function treats the entry as a miss (:class:`UnverifiableEntryError`) and stores its own.

Size: ``max_bytes`` bounds the bytes of all entries (all writers) up to one entry per writer racing on the last
free bytes. A full store admits nothing more and evicts nothing: features are read once per epoch in a new order,
where LRU would evict every entry before its reuse; a fixed subset keeps a hit rate of ``max_bytes / needed``.

Usage::

    store = FeatureStore("/data/cache/ns1", max_bytes=20 * 2**30)
    store.put(key, features)                   # key: 16 bytes; features: a CPU tensor
    entry = store.get(key)                     # None on a miss
    out = torch.empty(entry.shape, dtype=entry.dtype); store.read_into(entry, out)   # CorruptEntryError: bad bytes
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import struct
import weakref
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlmfast.common.safe_files import open_fd, write_atomic

__all__ = ["KEY_BYTES", "CorruptEntryError", "Entry", "FeatureStore", "UnverifiableEntryError", "store_summaries"]

KEY_BYTES = 16
MAX_DIMS = 6
ALIGN = 64  # entry offsets: whole cache lines
SEGMENT_BYTES = 1 << 30
MAX_WRITERS = 4096
# key, segment, offset, nbytes, stored dtype code, ndim, shape[6], dtype code the tower produced, checksum function
# code, checksum of the entry's bytes: 72 bytes
RECORD = struct.Struct(f"<{KEY_BYTES}sIQQBB{MAX_DIMS}IBBQ")
INDEX_SUFFIX = ".v2.idx"  # the record format is in the name: an older store's index is never misread
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.int8, torch.bool, torch.int16)
_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}


@dataclass(frozen=True)
class Entry:
    """Where one feature tensor lies: writer slot, segment, byte offset and size, dtype and shape (and the dtype the
    tower produced it in, when it was stored in another one)."""

    writer: int
    segment: int
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    source_dtype: torch.dtype
    checksum: int = 0  # of the bytes, by CHECKSUMS[checksum_kind]
    checksum_kind: int = 0


class CorruptEntryError(ValueError):
    """An entry's bytes do not match the checksum in its record (a damaged or tampered segment file)."""


class UnverifiableEntryError(CorruptEntryError):
    """The entry's checksum was made by a function this process lacks (``xxhash`` not installed): not known to be
    damaged, but not usable either."""


CHECKSUMS: dict[int, Any] = {1: zlib.crc32}  # code in the record -> function of a bytes-like object
with contextlib.suppress(ImportError):
    import xxhash

    CHECKSUMS[2] = xxhash.xxh3_64_intdigest
CHECKSUM_KIND = max(CHECKSUMS)  # the fastest this process has


class FeatureStore:
    """Per-image feature tensors on disk, keyed by 16-byte content keys; see the module docstring."""

    def __init__(self, path: str | Path, max_bytes: int, read_only: bool = False,
                 meta: dict[str, Any] | None = None, segment_bytes: int = SEGMENT_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.read_only = read_only
        self.segment_bytes = _align(min(int(segment_bytes), self.max_bytes))
        self.entries: dict[bytes, Entry] = {}
        self.bytes_used = 0
        self.full = False  # an entry was refused for lack of room
        self._index_read: dict[int, int] = {}  # writer -> bytes of its index already taken
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._lock_fd: int | None = None
        self._index_fd: int | None = None
        self._segment_fds: dict[int, int] = {}  # own segments, open for reserving space
        self._fds: list[int] = []  # every descriptor the store holds, closed by close() or the finalizer
        self._tails: dict[int, tuple[int, int]] = {}  # writer -> (segment, end) of its last recorded entry
        self.writer: int | None = None
        if not read_only:
            self.path.mkdir(parents=True, exist_ok=True)
            if meta is not None:
                _write_meta(self.path / "meta.json", meta)
            self.writer = self._claim_slot()
        self.refresh()
        if self.writer is not None:
            self._open_writer(self.writer)
        # A store dropped without close() (a trainer that just ends) still gives its files and writer slot back.
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)

    # ---- reading ----------------------------------------------------------------------------------------------
    def get(self, key: bytes) -> Entry | None:
        """The entry of `key`, or None."""
        return self.entries.get(key)

    def read_into(self, entry: Entry, out: torch.Tensor) -> torch.Tensor:
        """Copy an entry's bytes into `out` (a contiguous CPU tensor of the entry's dtype and shape) and verify them
        against the record's checksum; :class:`CorruptEntryError` when they differ."""
        if out.dtype != entry.dtype or tuple(out.shape) != entry.shape or not out.is_contiguous():
            raise ValueError(f"read_into: out is {out.dtype} {tuple(out.shape)}, the entry {entry.dtype} {entry.shape}")
        segment = self._map(entry.writer, entry.segment)
        if entry.offset + entry.nbytes > len(segment):
            raise CorruptEntryError(f"{self._segment_path(entry.writer, entry.segment)}: the entry at byte "
                                    f"{entry.offset} lies past the segment's end ({len(segment)} bytes)")
        function = CHECKSUMS.get(entry.checksum_kind)
        if function is None:
            raise UnverifiableEntryError(f"{self._segment_path(entry.writer, entry.segment)}: checksum function "
                                         f"{entry.checksum_kind} cannot be computed here (pip install xxhash)")
        target = _bytes_of(out)
        target[:] = np.frombuffer(segment, np.uint8, entry.nbytes, entry.offset)
        if function(target) != entry.checksum:
            raise CorruptEntryError(f"{self._segment_path(entry.writer, entry.segment)}: the {entry.nbytes} bytes at "
                                    f"{entry.offset} do not match their checksum")
        return out

    def read(self, entry: Entry) -> torch.Tensor:
        """A new CPU tensor holding the entry."""
        return self.read_into(entry, torch.empty(entry.shape, dtype=entry.dtype))

    def refresh(self) -> int:
        """Take the entries other writers appended since the last look; returns how many were new. Costs a folder
        listing and one ``stat`` per writer: the cache calls it only when a lookup missed."""
        if self.path.is_dir():
            for name in os.listdir(self.path):
                slot = name[1:-len(INDEX_SUFFIX)]
                if name.startswith("w") and name.endswith(INDEX_SUFFIX) and slot.isdigit():
                    self._index_read.setdefault(int(slot), 0)
        added = 0
        for writer, taken in list(self._index_read.items()):
            if writer == self.writer and self._index_fd is not None:
                continue  # our own appends are taken as we make them
            try:
                size = os.stat(self._index_path(writer)).st_size
            except FileNotFoundError:
                continue
            if size - taken >= RECORD.size:
                added += self._read_index(writer)
        return added

    # ---- writing ----------------------------------------------------------------------------------------------
    def put(self, key: bytes, tensor: torch.Tensor, source_dtype: torch.dtype | None = None,
            replace: bool = False) -> bool:
        """Store `tensor` (CPU) under `key`; False when read-only, already stored (unless `replace`: a corrupt
        entry's recomputed bytes), or the store is full. `source_dtype`: the dtype the features were computed in,
        when `tensor` was cast for storage. ``OSError`` when the disk has no room (nothing was written)."""
        if self.writer is None or (key in self.entries and not replace):
            return False
        if len(key) != KEY_BYTES:
            raise ValueError(f"keys are {KEY_BYTES} bytes, got {len(key)}")
        source_dtype = source_dtype or tensor.dtype
        if tensor.dim() > MAX_DIMS or tensor.dtype not in _CODES or source_dtype not in _CODES:
            raise ValueError(f"cannot store a {tensor.dtype} tensor of shape {tuple(tensor.shape)} "
                             f"(at most {MAX_DIMS} dims; dtypes {', '.join(map(str, DTYPES))})")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.segment_bytes or self.bytes_used + nbytes > self.max_bytes:
            self.full = True
            return False
        offset = _align(self._position)
        if offset + nbytes > self.segment_bytes:
            self._segment, offset = self._segment + 1, 0
        target = np.frombuffer(self._map(self.writer, self._segment, write=True), np.uint8, nbytes, offset)
        self._reserve(self._segment, offset, nbytes)  # a full disk raises here, not as a SIGBUS in the copy below
        data = _bytes_of(tensor.detach().contiguous())
        target[:] = data
        shape = tuple(tensor.shape)
        digest = CHECKSUMS[CHECKSUM_KIND](data)
        record = RECORD.pack(key, self._segment, offset, nbytes, _CODES[tensor.dtype], len(shape),
                             *shape, *([0] * (MAX_DIMS - len(shape))), _CODES[source_dtype], CHECKSUM_KIND, digest)
        self._position = offset + nbytes  # the bytes are spent even if the record cannot be appended
        os.write(self._index_fd, record)  # after the bytes: a reader never sees a record before its data
        self._index_read[self.writer] += RECORD.size
        self._add(key, Entry(self.writer, self._segment, offset, nbytes, tensor.dtype, shape, source_dtype, digest,
                             CHECKSUM_KIND))
        return True

    def disk_bytes(self) -> int:
        """Bytes the store's files take on disk (segments are sparse: written bytes only)."""
        total = 0
        for file in self.path.glob("w*"):
            with contextlib.suppress(OSError):  # another writer's file vanished (a cleaned-up store)
                total += file.stat().st_blocks * 512
        return total

    def close(self) -> None:
        """Unmap the segments and release the writer slot."""
        for mapped in self._maps.values():
            with contextlib.suppress(BufferError):  # a tensor still views it: the mapping goes with that tensor
                mapped.close()
        self._maps.clear()
        self._finalizer()
        self._segment_fds.clear()
        self._index_fd = self._lock_fd = None
        self.writer = None

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.entries)

    # ---- internals --------------------------------------------------------------------------------------------
    def _claim_slot(self) -> int:
        import fcntl

        for slot in range(MAX_WRITERS):
            fd = open_fd(self.path / f"w{slot}.lock", os.O_RDWR, what="feature cache lock")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._lock_fd = fd
            self._fds.append(fd)
            return slot
        raise RuntimeError(f"{self.path}: all {MAX_WRITERS} writer slots are taken")

    def _index_path(self, writer: int) -> Path:
        return self.path / f"w{writer}{INDEX_SUFFIX}"

    def _segment_path(self, writer: int, segment: int) -> Path:
        return self.path / f"w{writer}-{segment}.bin"

    def _open_writer(self, slot: int) -> None:
        self._index_fd = open_fd(self._index_path(slot), os.O_RDWR | os.O_APPEND, what="feature cache index")
        whole = self._index_read.get(slot, 0)
        if os.fstat(self._index_fd).st_size != whole:  # a torn record from a killed writer
            os.ftruncate(self._index_fd, whole)
        self._index_read[slot] = whole
        self._fds.append(self._index_fd)
        self._segment, self._position = self._tails.get(slot, (0, 0))

    def _reserve(self, segment: int, offset: int, nbytes: int) -> None:
        """Give the entry's byte range disk blocks before it is written through the map (the rest stays sparse)."""
        fd = self._segment_fds[segment]
        try:
            os.posix_fallocate(fd, offset, nbytes)
            return
        except AttributeError:  # no posix_fallocate on this platform
            pass
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        zeros, start, end = bytes(min(nbytes, 1 << 20)), offset, offset + nbytes
        while start < end:  # a short write is followed by the call that raises ENOSPC
            start += os.pwrite(fd, zeros[:end - start], start)

    def _read_index(self, writer: int) -> int:
        path = self._index_path(writer)
        start = self._index_read.get(writer, 0)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            return 0
        whole = len(data) - len(data) % RECORD.size  # a record being appended right now is taken next time
        added = 0
        for key, segment, offset, nbytes, code, ndim, *shape, source, kind, digest in RECORD.iter_unpack(data[:whole]):
            self._tails[writer] = max(self._tails.get(writer, (0, 0)), (segment, offset + nbytes))
            if code < len(DTYPES) and source < len(DTYPES) and ndim <= MAX_DIMS:
                added += key not in self.entries  # a later record of a key replaces a corrupt one
                self._add(key, Entry(writer, segment, offset, nbytes, DTYPES[code], tuple(shape[:ndim]),
                                     DTYPES[source], digest, kind))
        self._index_read[writer] = start + whole
        return added

    def _add(self, key: bytes, entry: Entry) -> None:
        self.entries[key] = entry
        self.bytes_used += entry.nbytes

    def _map(self, writer: int, segment: int, write: bool = False) -> mmap.mmap:
        mapped = self._maps.get((writer, segment))
        if mapped is not None:
            return mapped
        path = self._segment_path(writer, segment)
        own = writer == self.writer
        if write and not own:
            raise RuntimeError(f"writer {self.writer} cannot write writer {writer}'s segment")
        fd = open_fd(path, os.O_RDWR, what="feature cache segment") if own else os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if own and size < self.segment_bytes:
                os.ftruncate(fd, self.segment_bytes)  # sparse: takes no disk until written (_reserve)
                size = self.segment_bytes
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if own else mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        if own:  # kept open to reserve each entry's blocks
            self._segment_fds[segment] = fd
            self._fds.append(fd)
        else:
            os.close(fd)
        self._maps[(writer, segment)] = mapped
        return mapped


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor's bytes (any dtype, bf16 included)."""
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).numpy()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    if path.exists():
        return
    write_atomic(path, json.dumps(meta, indent=1, sort_keys=True, default=str), what="feature cache meta")


def store_summaries(root: str | Path) -> Iterable[tuple[Path, int, dict[str, Any]]]:
    """(folder, bytes on disk, meta) of every store under a cache root (for reports and clean-up)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        meta_path = folder / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        size = sum(f.stat().st_blocks * 512 for f in folder.glob("w*") if f.is_file())
        out.append((folder, size, meta))
    return out
