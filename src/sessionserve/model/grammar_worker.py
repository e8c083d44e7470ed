"""Compile grammars in a child process, so that one that takes too long can be stopped.

A JSON schema of a few kilobytes can take xgrammar minutes to compile (thousands
of properties, a deep nesting, a huge enum), and neither a thread nor xgrammar
can be interrupted. The child compiles one grammar at a time and sends it back
serialized; past `timeout_s` it is killed (and started again for the next one),
and the request that asked gets a clear error. A crash inside the compiler ends
the child, not the server.
"""

from __future__ import annotations

import multiprocessing
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from sessionserve.types.guided import GuidedDecoding

# Starting the child (imports, the tokenizer's grammar view) is not the request's time.
_START_TIMEOUT_S = 120.0


class GrammarTimeout(ValueError):
    """The grammar did not compile within the time limit."""


class GrammarWorker:
    """One child process that compiles grammars for one model folder; thread-safe (one compile at a time)."""

    def __init__(self, model_dir: str | Path, stop_token_ids: tuple[int, ...] | None, timeout_s: float) -> None:
        self.model_dir = str(model_dir)
        self.stop_token_ids = stop_token_ids
        self.timeout_s = timeout_s
        self.num_timeouts = 0
        self._lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def compile(self, guided: GuidedDecoding) -> str:
        """The compiled grammar, serialized (xgrammar's JSON). Raises ValueError for a bad spec, GrammarTimeout
        when it takes longer than `timeout_s`."""
        with self._lock:
            conn = self._ensure_started()
            conn.send(guided)
            if not conn.poll(self.timeout_s):
                self.num_timeouts += 1
                self._stop()
                raise GrammarTimeout(f"the {guided.kind} constraint took longer than {self.timeout_s:g} s to "
                                     f"compile; simplify it (fewer properties, enum values or nesting levels)")
            try:
                ok, payload = conn.recv()
            except (EOFError, OSError):
                self._stop()
                raise ValueError(f"cannot compile {guided.kind} constraint: the compiler failed") from None
        if not ok:
            raise ValueError(payload)
        return payload

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _ensure_started(self) -> Connection:
        if self._process is not None and self._process.is_alive() and self._conn is not None:
            return self._conn
        self._stop()
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs torch threads
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(child, self.model_dir, self.stop_token_ids),
                              name="sessionserve-grammar", daemon=True)
        process.start()
        child.close()
        if not parent.poll(_START_TIMEOUT_S):
            process.kill()
            raise RuntimeError("the grammar compiler process did not start")
        parent.recv()  # "ready"
        self._process, self._conn = process, parent
        return parent

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None


def _serve(conn: Connection, model_dir: str, stop_token_ids: tuple[int, ...] | None) -> None:
    """The child: compile what the parent sends until the pipe closes."""
    from sessionserve.model.structured import GrammarCompiler

    compiler = GrammarCompiler(model_dir, stop_token_ids)
    conn.send("ready")
    while True:
        try:
            guided = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send((True, compiler.compile(guided).serialize_json()))
        except ValueError as exc:
            conn.send((False, str(exc)))
        except RecursionError:
            conn.send((False, f"cannot compile {guided.kind} constraint: it is nested too deeply"))
