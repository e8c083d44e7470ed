"""Try grammars in child processes first, so that one that takes too long can be stopped.

A JSON schema of a few kilobytes can take xgrammar minutes to compile (thousands
of properties, a deep nesting, a huge enum), and neither a thread nor xgrammar
can be interrupted. Each child compiles one grammar at a time and answers
whether it compiled, and how large; past `timeout_s` it is killed (and started
again for the next one), and the request that asked gets a clear error. Two
children by default, so one slow schema does not hold up everyone else's; a
crash inside the compiler ends a child, not the server.

The server then compiles a grammar that passed again itself, on a thread below
its own priority (`lower_thread_priority`): xgrammar lets go of the interpreter
while it compiles, whereas loading a compiled grammar sent back would hold it
(~40 ms per serialized MiB, and 40 tools serialize to 3 MiB), a gap in every
stream then in flight. Children and that thread run below the server's CPU priority
with one compiler thread each: on a machine whose cores the engine keeps busy,
a compile takes what the engine leaves, never a core from under its step.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from sessionserve.types.guided import GuidedDecoding

# Starting a child (imports, the tokenizer's grammar view) is not the request's time.
_START_TIMEOUT_S = 120.0
COMPILE_NICENESS = 19  # how much lower than the server a compile's CPU priority is (the lowest)
# The most memory one compiled grammar may take (xgrammar's count): a constraint that compiles larger is the
# request's 400 (the cache holds up to 256 of them).
MAX_GRAMMAR_BYTES = 16 * 2**20


class GrammarTimeout(ValueError):
    """The grammar did not compile within the time limit."""


class GrammarBusy(RuntimeError):
    """No compiler child came free within the time limit (others' grammars hold them): retry later. Not a
    ValueError: it says nothing of the spec, which is neither refused nor remembered as failed."""


class GrammarWorker:
    """Child processes that compile grammars for one model folder; thread-safe."""

    def __init__(self, model_dir: str | Path, stop_token_ids: tuple[int, ...] | None, timeout_s: float,
                 num_children: int = 2) -> None:
        self.timeout_s = timeout_s
        self.num_timeouts = 0
        self.num_busy = 0  # checks refused because no child came free in time
        self._started = threading.Event()  # a child has been ready once
        self.num_children = num_children
        self._children: list[_Child] = [_Child(str(model_dir), stop_token_ids) for _ in range(num_children)]
        self._free: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        for child in self._children:
            self._release(child)  # started in the background: a compile waits only for the first to be ready

    def check(self, guided: GuidedDecoding) -> int:
        """How many bytes `guided` compiles to. Raises ValueError for a bad spec or one that compiles larger than
        MAX_GRAMMAR_BYTES, GrammarTimeout when it takes longer than `timeout_s`, GrammarBusy when no child
        came free within `timeout_s` (so a request waits at most twice the limit, whatever others send)."""
        try:  # the first children's start (seconds: they import torch) is not others' grammars holding them
            child = self._free.get(timeout=self.timeout_s if self._started.is_set() else _START_TIMEOUT_S)
        except queue.Empty:
            self.num_busy += 1
            raise GrammarBusy(f"every grammar compiler was busy for {self.timeout_s:g} s; retry shortly") from None
        try:
            return child.check(guided, self.timeout_s)
        except GrammarTimeout:
            self.num_timeouts += 1
            raise
        finally:
            self._release(child)

    def close(self) -> None:
        for child in self._children:
            child.stop()

    def _release(self, child: _Child) -> None:
        """Make `child` free again; one that was stopped (it took too long) starts anew first, in the background,
        so the next request does not wait for a process to start."""
        if child.is_running:
            self._free.put(child)
            self._started.set()
            return

        def start() -> None:
            with contextlib.suppress(Exception):  # a child that cannot start fails its next compile instead
                child.start()
            self._free.put(child)
            self._started.set()

        threading.Thread(target=start, name="grammar-start", daemon=True).start()


class _Child:
    """One compiler process, started on first use; used by one thread at a time."""

    def __init__(self, model_dir: str, stop_token_ids: tuple[int, ...] | None) -> None:
        self.model_dir = model_dir
        self.stop_token_ids = stop_token_ids
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None and self._conn is not None

    def check(self, guided: GuidedDecoding, timeout_s: float) -> int:
        conn = self.start()
        conn.send(guided)
        if not conn.poll(timeout_s):
            self.stop()
            raise GrammarTimeout(f"the {guided.kind} constraint took longer than {timeout_s:g} s to compile; "
                                 f"simplify it (fewer properties, enum values or nesting levels)")
        try:
            ok, payload = conn.recv()
        except (EOFError, OSError):
            self.stop()
            raise ValueError(f"cannot compile {guided.kind} constraint: the compiler failed") from None
        if not ok:
            raise ValueError(payload)
        return payload

    def start(self) -> Connection:
        """The connection to a running child, started if it is not."""
        if self.is_running:
            assert self._conn is not None
            return self._conn
        self.stop()
        # A fresh interpreter (`python -m`), not multiprocessing: no fork of a process that runs torch threads,
        # and no re-import of the parent's __main__ (a script that starts a server needs no main guard).
        ours, theirs = socket.socketpair()
        args = json.dumps([self.model_dir, list(self.stop_token_ids) if self.stop_token_ids else None])
        process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno()), args],
                                   pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        conn = Connection(ours.detach())
        if not conn.poll(_START_TIMEOUT_S):
            process.kill()
            conn.close()
            raise RuntimeError("the grammar compiler process did not start")
        conn.recv()  # "ready"
        self._process, self._conn = process, conn
        return conn

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(5)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None


def lower_thread_priority() -> None:
    """Run the calling thread (on Linux: this thread alone; elsewhere the process) at COMPILE_NICENESS."""
    with contextlib.suppress(OSError, AttributeError):  # no setpriority here, or not allowed: run as is
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id() if sys.platform == "linux" else 0, COMPILE_NICENESS)


def _serve(conn: Connection, model_dir: str, stop_token_ids: tuple[int, ...] | None,
           max_bytes: int = MAX_GRAMMAR_BYTES) -> None:
    """The child: compile what the parent sends, answering with the compiled size or why not, until the
    connection closes."""
    from sessionserve.model.structured import GrammarCompiler

    compiler = GrammarCompiler(model_dir, stop_token_ids, max_threads=1)
    conn.send("ready")
    while True:
        try:
            guided = conn.recv()
        except (EOFError, OSError):
            return
        try:
            size = compiler.compile_uncached(guided).memory_size_bytes  # the server keeps what passes
        except ValueError as exc:
            conn.send((False, str(exc)))
            continue
        if size > max_bytes:
            conn.send((False, f"the {guided.kind} constraint compiles to {size / 2**20:.0f} MiB, more than the "
                              f"{max_bytes / 2**20:.0f} MiB allowed; simplify it (fewer properties, enum values or "
                              f"nesting levels)"))
        else:
            conn.send((True, size))


if __name__ == "__main__":
    # Below the engine in the CPU's queue (this child's start, torch's import included). The limit in
    # `timeout_s` still applies.
    os.nice(COMPILE_NICENESS)
    model_dir, stop_ids = json.loads(sys.argv[2])
    with contextlib.suppress(OSError, EOFError):  # the server went away (or stopped this child): just end
        _serve(Connection(int(sys.argv[1])), model_dir, tuple(stop_ids) if stop_ids else None)
