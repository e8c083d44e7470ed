"""Alice, the bystander tenant of the noisy-neighbour harness: steady greedy chat streams, timed per token.

She runs in a process of her own, as a client would: her HTTP client and SSE
parsing take none of the server's interpreter, so a gap in her streams is the
server's doing. `Bystander` starts that process per phase and collects every
stream's result when it stops.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from typing import NamedTuple

import httpx

ALICE_KEY = "key-alice"
# Alice's prompts and how many tokens each streams (ignore_eos: the count is fixed).
PROMPTS: tuple[tuple[str, int], ...] = (
    ("Summarize the design of a paged KV cache in two sentences.", 30),
    ("List three ways a scheduler can keep latency low for interactive users.", 36),
    ("Write a haiku about a server that never stalls.", 42),
    ("Explain what a noisy neighbour is in a shared inference service.", 48),
    ("def fibonacci(n):\n    # complete this function", 54),
    ("Translate to French: the quick brown fox jumps over the lazy dog.", 60),
)


class StreamResult(NamedTuple):
    """One of Alice's streams: what came back and when."""

    prompt_index: int
    phase: str
    status: int
    text: str
    finish_reason: str | None
    num_tokens: int
    ttft_s: float | None
    token_times: tuple[float, ...]  # wall clock (time.time()) of each content chunk
    error: str | None  # why it failed (None: it completed)

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Gaps between consecutive content chunks, of those that end in [start, end)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:]) if start <= b < end]


def stream_once(client: httpx.Client, prompt_index: int, phase: str, request_id: str) -> StreamResult:
    prompt, max_tokens = PROMPTS[prompt_index]
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.time()
    times: list[float] = []
    parts: list[str] = []
    finish, num_tokens, error, status = None, 0, None, 0
    try:
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-ID": request_id}) as r:
            status = r.status_code
            if status != 200:
                return StreamResult(prompt_index, phase, status, "", None, 0, None, (), r.read()[:300].decode())
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    error = f"error event: {event['error']}"
                    break
                if event.get("usage"):
                    num_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", ()):
                    if choice["delta"].get("content"):
                        times.append(time.time())
                        parts.append(choice["delta"]["content"])
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        error = f"transport: {type(exc).__name__}: {exc}"
    if error is None and (finish != "length" or num_tokens != max_tokens):
        error = f"ended early: finish_reason={finish} tokens={num_tokens}/{max_tokens}"
    return StreamResult(prompt_index, phase, status, "".join(parts), finish, num_tokens,
                        times[0] - t0 if times else None, tuple(times), error)


PHASE_BYTES = 64  # room for the name of the phase her streams are in


def _alice(url: str, num_streams: int, num_per_worker: int | None, phase, stop, out) -> None:  # noqa: ANN001
    """The child: `num_streams` workers, each streaming PROMPTS in turn under a fixed X-Request-ID, until
    `stop` is set (or `num_per_worker` streams each); then every result goes to `out`."""
    results: list[StreamResult] = []

    def work(worker: int) -> None:
        with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ALICE_KEY}"}) as c:
            i = worker
            while not stop.is_set() and (num_per_worker is None or i - worker < num_per_worker):
                name = phase.value.decode()
                results.append(stream_once(c, i % len(PROMPTS), name, request_id(worker)))  # atomic append
                i += 1

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(num_streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(results)


def request_id(worker: int) -> str:
    return f"alice-stream-{worker}"


class Bystander:
    """Alice: `num_streams` streams at a time over PROMPTS, each worker under a fixed X-Request-ID, in a
    process of her own (started per `start` / `run_rounds`)."""

    def __init__(self, url: str, num_streams: int = 2) -> None:
        self.url = url
        self.num_streams = num_streams
        self._ctx = multiprocessing.get_context("spawn")  # not fork: the caller may run the server's threads
        self._phase = self._ctx.Array("c", PHASE_BYTES)
        self._stop = self._ctx.Event()
        self._out = None
        self._process = None
        self.results: list[StreamResult] = []

    @property
    def phase(self) -> str:
        return self._phase.value.decode()

    @phase.setter
    def phase(self, name: str) -> None:
        self._phase.value = name.encode()[:PHASE_BYTES - 1]

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(request_id(w) for w in range(self.num_streams))

    def start(self, phase: str, num_per_worker: int | None = None) -> None:
        self.phase, self.results = phase, []
        self._stop.clear()
        self._out = self._ctx.Queue()
        self._process = self._ctx.Process(target=_alice, daemon=True, args=(
            self.url, self.num_streams, num_per_worker, self._phase, self._stop, self._out))
        self._process.start()

    def _collect(self) -> list[StreamResult]:
        assert self._out is not None and self._process is not None
        self.results = self._out.get(timeout=600)  # before join: a large result must leave the pipe first
        self._process.join(30)
        self._out = self._process = None
        return self.results

    def stop(self) -> list[StreamResult]:
        """Let each worker finish its current stream; return every stream since `start`."""
        self._stop.set()
        return self._collect()

    def run_rounds(self, phase: str, num_rounds: int) -> list[StreamResult]:
        """Every prompt `num_rounds` times (split over the workers), then stop."""
        self.start(phase, num_per_worker=-(-num_rounds * len(PROMPTS) // self.num_streams))
        return self._collect()


