"""Tokenizing a long text lets other threads run (the server's engine and event loop share the interpreter)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sessionserve.model.tokenizer import RELEASE_GIL_CHARS, Tokenizer


def test_long_texts_tokenize_the_same_and_without_holding_the_interpreter(tiny_llama: Path) -> None:
    tok = Tokenizer(tiny_llama)
    text = "def f(x):\n    return x * 2  # a line of code, and words\n" * 4000  # ~230k characters
    assert len(text) >= RELEASE_GIL_CHARS
    short = text[:RELEASE_GIL_CHARS - 1]
    assert tok.encode(text) == [*([tok.bos_token_id] if tok.add_bos and tok.bos_token_id is not None else []),
                                *tok._tok.encode(text, add_special_tokens=False).ids]
    assert tok.encode(short, add_special_tokens=False) == tok._tok.encode(short, add_special_tokens=False).ids

    done = threading.Event()
    ticks = 0

    def tokenize() -> None:
        for _ in range(5):
            tok.encode(text)
        done.set()

    worker = threading.Thread(target=tokenize)
    t0 = time.perf_counter()
    worker.start()
    while not done.is_set():  # this thread counts while the worker tokenizes
        ticks += 1
        time.sleep(0)
    worker.join()
    elapsed = time.perf_counter() - t0
    # Holding the interpreter, the worker would let this loop run only at switch intervals (5 ms): about
    # elapsed / 5 ms ticks. Released, the loop spins freely, orders of magnitude more.
    assert ticks > 20 * elapsed / 0.005, (ticks, elapsed)
