"""The disk tier of the KV cache: one checksummed spool file per parked block group.

File format (little endian): a fixed header
  magic b"SSKV" | version u16 | reserved u16 | num_blocks u64 | dtype name 16s |
  num_layers, num_kv_heads, block_size, head_dim u32 x4 | payload_bytes u64 | crc32 u32
followed by the payload: the raw (n, L, 2, Hkv, bs, D) tensor bytes. The crc32
covers the header fields before it and the payload, so a flipped byte anywhere
is caught. crc32 rather than a cryptographic hash: the threat is bit rot and
torn files, not an adversary (the directory is 0o700 and names are ours), and
it is ~4x faster than blake2b, which would otherwise bound the mover's speed.

Files are named by us (uuid4 hex + ".kv"), written to a temp name and renamed,
never fsynced: the spool does not outlive the process, so durability is moot.

Ownership: each live tier holds a shared flock on the spool directory (the
kernel drops it when the process dies, also on SIGKILL). A starting tier that
can take the lock exclusively knows no live tier uses the directory, so every
file of our naming in it was left by a dead process: it removes and counts
them. Several live processes may share a directory (replicas of one machine);
files left by a dead one then wait until a start finds no live peer.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import re
import struct
import threading
import uuid
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from sessionserve.cache.kv_layout import KVLayout

MAGIC = b"SSKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHQ16s4IQ")  # everything before the checksum
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _CRC.size
_CHUNK_BYTES = 8 << 20  # bounded syscalls; lets other threads run between chunks
_SPOOL_NAME = re.compile(r"[0-9a-f]{32}\.kv(\.[0-9a-f]{8}\.tmp)?")  # a spool file or its temp file

logger = logging.getLogger(__name__)


class CorruptKVError(Exception):
    """A spool file is missing, truncated, or fails its header or checksum check."""


@dataclass(frozen=True)
class DiskHandle:
    """A reservation of `size_bytes` (header + payload) for `num_blocks` blocks at `path`."""

    path: Path
    num_blocks: int
    size_bytes: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of contiguous CPU `tensor`'s memory (no copy; keep `tensor` alive)."""
    num_bytes = tensor.numel() * tensor.element_size()
    if num_bytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * num_bytes).from_address(tensor.data_ptr())).cast("B")


def _write_fully(fd: int, data: memoryview) -> None:
    """Write all of `data` to `fd`, retrying short writes. Raises OSError (e.g. ENOSPC)."""
    offset = 0
    while offset < len(data):
        offset += os.write(fd, data[offset:offset + _CHUNK_BYTES])


def _unlink_quietly(path: Path) -> None:
    """Remove `path` if present. Errors are logged, not raised: this runs on cleanup
    paths (free, close) that must always release the budget, and a file we cannot
    delete (e.g. the spool dir vanished) cannot be helped by the caller either."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("could not remove KV spool file %s: %s", path, exc)


def _header(layout: KVLayout, num_blocks: int, payload_bytes: int) -> bytes:
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, num_blocks, _dtype_name(layout.dtype).encode("ascii"),
                        layout.num_layers, layout.num_kv_heads, layout.block_size, layout.head_dim, payload_bytes)


def write_kv_file(path: Path, layout: KVLayout, data: torch.Tensor) -> None:
    """Write block group `data` (n, L, 2, Hkv, bs, D) to `path`, atomically.

    Written under a temp name unique to this writer and renamed, so no partial
    file is ever visible under `path`, also with other processes writing the
    same path. Raises OSError on failure, leaving no temp file behind.
    """
    payload = data.to("cpu", layout.dtype).contiguous()
    payload_view = _byte_view(payload)
    header = _header(layout, data.shape[0], len(payload_view))
    crc = zlib.crc32(payload_view, zlib.crc32(header))
    tmp_path = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_fully(fd, memoryview(header + _CRC.pack(crc)))
            _write_fully(fd, payload_view)
        finally:
            os.close(fd)
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def read_kv_file(path: Path, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """The `num_blocks` block group stored at `path`, as a new CPU tensor in the layout dtype.

    Raises CorruptKVError if the file is missing, has the wrong size, a header
    that does not match `layout` and `num_blocks`, or a bad checksum; other I/O
    errors propagate as OSError.
    """
    size_bytes = HEADER_BYTES + num_blocks * layout.block_bytes
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise CorruptKVError(f"KV file {path.name} is missing") from exc
    try:
        file_bytes = os.fstat(fd).st_size
        if file_bytes != size_bytes:
            raise CorruptKVError(f"KV file {path.name} has {file_bytes} bytes, expected {size_bytes}")
        header_and_crc = os.read(fd, HEADER_BYTES)
        out = torch.empty(layout.group_shape(num_blocks), dtype=layout.dtype)
        out_view = _byte_view(out)
        if len(header_and_crc) != HEADER_BYTES or _read_into(fd, out_view) != len(out_view):
            raise CorruptKVError(f"KV file {path.name} is truncated")
    finally:
        os.close(fd)
    header, (stored_crc,) = header_and_crc[:_HEADER.size], _CRC.unpack(header_and_crc[_HEADER.size:])
    if header != _header(layout, num_blocks, len(out_view)):
        raise CorruptKVError(f"KV file {path.name} has a mismatched header")
    if zlib.crc32(out_view, zlib.crc32(header)) != stored_crc:
        raise CorruptKVError(f"KV file {path.name} fails its checksum")
    return out


def _read_into(fd: int, view: memoryview) -> int:
    """Fill `view` from `fd`; returns bytes read (less than len(view) only at EOF)."""
    offset = 0
    while offset < len(view):
        num_read = os.readv(fd, [view[offset:offset + _CHUNK_BYTES]])
        if num_read == 0:
            break
        offset += num_read
    return offset


def _open_private_dir(spool_dir: Path) -> int:
    """An fd of existing directory `spool_dir`, made 0o700 (it holds prompt contents).

    Raises PermissionError if the directory belongs to another user: its owner
    could open it up again at any time, so it can never be private to us.
    """
    fd = os.open(spool_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionError(f"KV spool dir {spool_dir} belongs to uid {st.st_uid}, not to us")
        if st.st_mode & 0o777 != 0o700:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _claim_spool_dir(spool_dir: Path, dir_fd: int) -> tuple[int, int]:
    """Take a shared flock on `dir_fd`, first removing the files of dead owners.

    Returns (files, bytes) removed. Only files of our naming are removed, and
    only when no live tier holds the lock; a removal that fails is logged.
    """
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        # A live tier uses the directory, so we cannot tell its files from a dead one's.
        # Blocks only while another starting tier removes orphans.
        fcntl.flock(dir_fd, fcntl.LOCK_SH)
        return 0, 0
    except OSError as exc:  # e.g. some network file systems refuse flock on a directory
        logger.warning("cannot lock KV spool dir %s (%s): files of dead processes are left in it", spool_dir, exc)
        return 0, 0
    num_files = num_bytes = 0
    for path in spool_dir.iterdir():
        if not _SPOOL_NAME.fullmatch(path.name):
            continue
        try:
            size_bytes = path.lstat().st_size
            path.unlink()
        except OSError as exc:
            logger.warning("could not remove orphan KV spool file %s: %s", path, exc)
            continue
        num_files += 1
        num_bytes += size_bytes
    # NOTE: not atomic on Linux (unlock, then lock), which is fine: we own no file yet.
    fcntl.flock(dir_fd, fcntl.LOCK_SH)
    return num_files, num_bytes


class DiskTier:
    """Budgeted spool of block-group files in `spool_dir`.

    Threading: `try_reserve`/`free` run on the engine thread, `write`/`read` on
    the mover thread; `_lock` guards the reservation and written sets.

    Invariants: `used_bytes` is the sum of `size_bytes` of reserved handles and
    never exceeds `budget_bytes`; every path in `_written` is reserved. Files in
    the spool dir that we did not create are never touched nor counted, except
    at construction: files of our naming left by dead processes are removed
    (counted in `num_removed_orphan_files` and `num_removed_orphan_bytes`). The
    spool dir is 0o700 and our files 0o600; we hold a shared flock on the dir
    until the tier is garbage collected or the process exits.
    """

    def __init__(self, layout: KVLayout, spool_dir: str | Path, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.layout = layout
        self.spool_dir = Path(spool_dir)
        self.budget_bytes = budget_bytes
        # 0o700: parked KV reveals the sessions' prompts; other users must not read it.
        self.spool_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._dir_fd = _open_private_dir(self.spool_dir)
        weakref.finalize(self, os.close, self._dir_fd)  # closing the fd drops the flock
        self.num_removed_orphan_files, self.num_removed_orphan_bytes = _claim_spool_dir(self.spool_dir, self._dir_fd)
        if self.num_removed_orphan_files:
            logger.info("removed %d KV spool files (%d bytes) left by dead processes in %s",
                        self.num_removed_orphan_files, self.num_removed_orphan_bytes, self.spool_dir)
        self._lock = threading.Lock()
        self._reserved: dict[Path, DiskHandle] = {}
        self._written: set[Path] = set()
        self._used_bytes = 0

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used_bytes

    @property
    def num_files(self) -> int:
        """Files currently written by us and not yet freed."""
        with self._lock:
            return len(self._written)

    def try_reserve(self, num_blocks: int) -> DiskHandle | None:
        """Reserve budget for a `num_blocks` group, or return None if it would not fit.

        Mutates the budget accounting only; creates no file.
        """
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        size_bytes = HEADER_BYTES + num_blocks * self.layout.block_bytes
        handle = DiskHandle(self.spool_dir / f"{uuid.uuid4().hex}.kv", num_blocks, size_bytes)
        with self._lock:
            if self._used_bytes + size_bytes > self.budget_bytes:
                return None
            self._reserved[handle.path] = handle
            self._used_bytes += size_bytes
        return handle

    def write(self, handle: DiskHandle, data: torch.Tensor) -> None:
        """Write block group `data` (n, L, 2, Hkv, bs, D) to `handle`'s file.

        Creates/replaces the file atomically (temp name + rename); no partial
        file is ever visible under the final name. Raises OSError on failure,
        leaving no temp file behind and the handle still reserved (the caller
        frees it). Raises ValueError for a handle that is not reserved.
        """
        expected = self.layout.group_shape(handle.num_blocks)
        if tuple(data.shape) != expected:
            raise ValueError(f"data shape {tuple(data.shape)} != {expected}")
        with self._lock:
            if handle.path not in self._reserved:
                raise ValueError("write to a disk handle that is not reserved")
        write_kv_file(handle.path, self.layout, data)
        with self._lock:
            if handle.path in self._reserved:
                self._written.add(handle.path)
                return
        # Freed while we were writing: the file we just renamed into place is orphaned.
        _unlink_quietly(handle.path)

    def read(self, handle: DiskHandle) -> torch.Tensor:
        """The block group stored under `handle`, as a new CPU tensor in the layout dtype.

        Mutates nothing. Raises CorruptKVError if the file is missing, has the
        wrong size, a header that does not match the handle and layout, or a
        bad checksum; other I/O errors propagate as OSError.
        """
        return read_kv_file(handle.path, self.layout, handle.num_blocks)

    def free(self, handle: DiskHandle) -> None:
        """Delete `handle`'s file and release its budget.

        Idempotent: freeing an already freed handle does nothing. Never raises
        for a file it cannot delete (logged; the budget is released anyway).
        """
        with self._lock:
            if self._reserved.pop(handle.path, None) is None:
                return
            self._written.discard(handle.path)
            self._used_bytes -= handle.size_bytes
        _unlink_quietly(handle.path)

    def close(self) -> None:
        """Free every handle, removing every file this tier wrote. The tier stays usable."""
        with self._lock:
            handles = list(self._reserved.values())
        for handle in handles:
            self.free(handle)
