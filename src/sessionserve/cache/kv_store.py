"""A KV tier on a folder that many replicas share: one file per block, named by its content.

    <root>/<namespace>/<hh>/<block hash hex>.kv      (hh: the hash's first byte: 256 subfolders)

A block's name is its chained hash (cache/block_hash.py), which covers its
tokens, every token before them and the tenant's salt; the namespace pins the
model (config and weights) and the KV layout (dtype, block size, shape). So a
file holds exactly the KV any replica of that model would compute for that
prefix, and any of them may read it: this is how a session outlives the
replica that held it. Files use the disk tier's checksummed format
(`write_kv_file`); one that fails its check is deleted and counts as absent.

Writers race harmlessly: each writes a temp file of its own and renames it
into place, and equal names mean equal content. The budget is kept by each
writer removing the least recently used files (by mtime; a read touches its
file) when its estimate of the folder's size passes the budget; the estimate
is its own writes since its last scan of the folder, so with many writers the
folder may exceed the budget by what they wrote between scans.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from sessionserve.cache.disk_tier import HEADER_BYTES, CorruptKVError, read_kv_file, write_kv_file
from sessionserve.cache.kv_layout import KVLayout

logger = logging.getLogger(__name__)

_SAMPLE_BYTES = 1 << 20  # of each weights file's head and tail, for the namespace
TRIM_TO = 0.9  # a trim leaves the folder at this fraction of its budget


def model_namespace(model_dir: str | Path, layout: KVLayout) -> str:
    """Name of the folder for KV of this model and layout: equal only for the same config, weights and layout.

    The weights enter by size and their first and last MiB per file (reading whole checkpoints would take
    seconds per replica start; a fine-tune changes its header's offsets or its data at both ends).
    """
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=10)
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(_SAMPLE_BYTES))
            f.seek(max(0, size - _SAMPLE_BYTES))
            h.update(f.read(_SAMPLE_BYTES))
    h.update(repr((layout.num_layers, layout.num_kv_heads, layout.block_size, layout.head_dim,
                   str(layout.dtype))).encode())
    return h.hexdigest()


class KVStore:
    """Blocks by hash in a shared folder. Thread-safe; safe across processes (see the module docstring)."""

    def __init__(self, root: str | Path, namespace: str, layout: KVLayout, budget_bytes: int) -> None:
        if budget_bytes < 1:
            raise ValueError("budget_bytes must be >= 1")
        self.dir = Path(root) / namespace
        # 0o700: KV reveals the prompts; other users of the machine must not read it.
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.file_bytes = HEADER_BYTES + layout.block_bytes
        self._lock = threading.Lock()
        self._estimate_bytes = self._scan_bytes()
        self.num_trimmed = 0  # files this store removed for the budget
        self.num_corrupt = 0  # files that failed their check on read (removed)

    def path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / f"{name}.kv"

    def contains(self, block_hash: bytes) -> bool:
        return self.path(block_hash).exists()

    def touch(self, block_hash: bytes) -> bool:
        """Mark the block as just used (the trim removes it last). False if the folder no longer has it."""
        try:
            os.utime(self.path(block_hash))
        except FileNotFoundError:
            return False
        except OSError:
            pass  # present but not ours to touch: still a hit for readers
        return True

    def put(self, block_hash: bytes, block: torch.Tensor) -> bool:
        """Store one block (L, 2, Hkv, bs, D) under its hash. False if it was there already.

        Raises OSError if the file cannot be written (no partial file is left).
        """
        path = self.path(block_hash)
        if path.exists():
            return False
        path.parent.mkdir(mode=0o700, exist_ok=True)
        write_kv_file(path, self.layout, block.unsqueeze(0))
        with self._lock:
            self._estimate_bytes += self.file_bytes
            over = self._estimate_bytes > self.budget_bytes
        if over:
            self.trim()
        return True

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block (L, 2, Hkv, bs, D) stored under `block_hash`, or None if absent, corrupt or unreadable.

        Touches the file (it becomes the most recently used). A corrupt file is removed.
        """
        path = self.path(block_hash)
        try:
            data = read_kv_file(path, self.layout, 1)
        except CorruptKVError as exc:
            if path.exists():
                logger.warning("KV store file dropped: %s", exc)
                self.num_corrupt += 1
                try:
                    path.unlink(missing_ok=True)
                except OSError:
                    pass  # not ours to remove (e.g. a folder under that name): it stays a miss
            return None
        except OSError as exc:  # unreadable (permissions, I/O error): a miss, the request recomputes
            logger.warning("KV store file unreadable: %s", exc)
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # removed meanwhile (another replica's trim): the data read is still whole
        return data[0]

    def trim(self) -> int:
        """Remove least recently used files until the folder is at `TRIM_TO` of the budget. Returns how many."""
        files = []
        for path in self.dir.glob("*/*.kv"):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        target = int(self.budget_bytes * TRIM_TO)
        removed = 0
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= target:
                break
            path.unlink(missing_ok=True)
            total -= size
            removed += 1
        with self._lock:
            self._estimate_bytes = total
            self.num_trimmed += removed
        return removed

    @property
    def used_bytes(self) -> int:
        """This store's estimate of the folder's size (exact after a scan or trim)."""
        with self._lock:
            return self._estimate_bytes

    def _scan_bytes(self) -> int:
        total = 0
        for path in self.dir.glob("*/*.kv"):
            try:
                total += path.stat().st_size
            except OSError:
                pass
        return total
