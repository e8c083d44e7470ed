"""Spool ownership: a SIGKILLed server's parked KV files are removed at the next start, never a live one's.

A real process parks sessions on disk and is killed with SIGKILL (no cleanup
runs). A new engine on the same spool dir removes and counts the dead one's
files, and after one more park the dir is within the disk budget. A live
process's files are left alone. The spool dir is made private whatever it was.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from sessionserve import LLMEngine, SamplingParams
from sessionserve.cache.disk_tier import DiskTier
from sessionserve.cache.kv_layout import KVLayout
from sessionserve.config import Config
from sessionserve.core.residency import ActionKind, ResidencyAction
from sessionserve.core.session import Residency
from sessionserve.obs.metrics import Metrics
from sessionserve.types.kv_mover import Tier

REPO_ROOT = Path(__file__).resolve().parents[2]
DISK_KV_BYTES = 1 << 20  # each parked session below is 7 blocks (~230 KB): 4 fit, 5 do not
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
READY_TIMEOUT_S = 120.0  # importing torch on a loaded 2-core machine takes a while

# The other process: parks `n` sessions on disk, says "ready", then waits to be killed.
CHILD = """
import sys, time
from pathlib import Path
from tests.reliability.test_spool_ownership import make_engine, park_on_disk
engine = make_engine(Path(sys.argv[1]), Path(sys.argv[2]))
for seed in range(int(sys.argv[3])):
    park_on_disk(engine, seed)
print("ready", flush=True)
time.sleep(600)
"""


def make_engine(model_dir: Path, spool: Path) -> LLMEngine:
    config = Config.from_kwargs(num_blocks=64, block_size=16, residency_policy="keep", host_kv_bytes=0,
                                disk_kv_bytes=DISK_KV_BYTES, spool_dir=str(spool), num_threads=1)
    return LLMEngine(config, model_dir)


def park_on_disk(engine: LLMEngine, seed: int) -> None:
    """Run one 100-token turn of a new session, then park its KV in the disk tier."""
    prompt = torch.randint(50, 16000, (100,), generator=torch.Generator().manual_seed(seed)).tolist()
    sid = engine.open_session()
    rid = engine.add_request(prompt, GREEDY, session_id=sid)
    while not any(out.request_id == rid and out.finished for out in engine.step()):
        pass
    engine.park(sid)
    engine.sessions.apply(ResidencyAction(ActionKind.OFFLOAD, sid, Tier.DISK), time.monotonic())
    deadline = time.monotonic() + 30
    while engine.get_session(sid).residency is not Residency.DISK:
        assert time.monotonic() < deadline, f"session stuck at {engine.get_session(sid).residency}"
        engine.sessions.tick(time.monotonic(), 0)
        time.sleep(0.005)


@contextmanager
def spooling_process(model_dir: Path, spool: Path, num_sessions: int, log: Path) -> Iterator[subprocess.Popen]:
    """A separate process that has parked `num_sessions` sessions in `spool`; SIGKILLed on exit."""
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(model_dir), str(spool), str(num_sessions)],
                                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        assert line.strip() == "ready", f"child not ready: {line!r}\n{log.read_text()[-3000:]}"
        yield proc
    finally:
        proc.kill()  # SIGKILL: nothing in the child gets to clean up
        proc.wait(timeout=30)
        proc.stdout.close()


def spool_files(spool: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in spool.iterdir()}


def test_dead_process_files_are_removed_and_counted(tiny_llama: Path, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    with spooling_process(tiny_llama, spool, 4, tmp_path / "child.log") as proc:
        dead = spool_files(spool)
        assert len(dead) == 4 and all(name.endswith(".kv") for name in dead), dead
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert spool_files(spool) == dead  # nobody cleaned up

    engine = make_engine(tiny_llama, spool)
    try:
        disk = engine.mover.disk
        assert disk.num_removed_orphan_files == 4
        assert disk.num_removed_orphan_bytes == sum(dead.values())
        assert not list(spool.iterdir())
        metrics = Metrics("tiny")
        metrics.sample_gauges(engine)
        text = metrics.render().decode()
        assert 'sessionserve_spool_orphans_removed{model="tiny",unit="files"} 4.0' in text, text
        park_on_disk(engine, seed=99)
        after = spool_files(spool)
        assert len(after) == 1 and not set(after) & set(dead), after
        # Without the removal the dir would now hold five sessions, past the budget.
        assert sum(dead.values()) + sum(after.values()) > DISK_KV_BYTES
        assert sum(after.values()) == disk.used_bytes <= DISK_KV_BYTES
    finally:
        engine.close()


def test_live_process_files_are_kept(tiny_llama: Path, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    with spooling_process(tiny_llama, spool, 2, tmp_path / "child.log") as proc:
        live = spool_files(spool)
        assert len(live) == 2, live
        engine = make_engine(tiny_llama, spool)
        try:
            disk = engine.mover.disk
            assert disk.num_removed_orphan_files == 0 and disk.num_removed_orphan_bytes == 0
            park_on_disk(engine, seed=99)
            both = spool_files(spool)
            assert len(both) == 3 and all(both[name] == size for name, size in live.items()), both
            assert proc.poll() is None  # still alive all along
        finally:
            engine.close()
        assert spool_files(spool).keys() == live.keys()  # our close removed only our own file


def test_spool_dir_is_made_private(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32)
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    os.chmod(spool, 0o755)  # mkdir's mode is cut by the umask
    stale = spool / f"{'ab' * 16}.kv"
    stale.write_bytes(b"x" * 100)
    foreign = spool / "notes.txt"  # not of our naming: never touched
    foreign.write_text("keep me")

    disk = DiskTier(layout, spool, budget_bytes=1 << 20)
    assert spool.stat().st_mode & 0o777 == 0o700
    assert (disk.num_removed_orphan_files, disk.num_removed_orphan_bytes) == (1, 100)
    assert not stale.exists() and foreign.read_text() == "keep me"
    handle = disk.try_reserve(2)
    assert handle is not None
    disk.write(handle, torch.zeros(layout.group_shape(2)))
    assert handle.path.stat().st_mode & 0o777 == 0o600
    disk.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a dir to another user needs root")
def test_spool_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, block_size=4, head_dim=8, dtype=torch.float32)
    spool = tmp_path / "spool"
    spool.mkdir()
    os.chown(spool, 12345, 12345)
    with pytest.raises(PermissionError, match="belongs to uid 12345"):
        DiskTier(layout, spool, budget_bytes=1 << 20)
