"""Fuzzed requests for the noisy-neighbour harness: drawn from the full ranges JSON and the types allow.

`fuzz_requests` draws requests (ints to +-2**70, NaN and infinities, strings
up to the body limit, nesting 100,000 deep, token ids past the vocabulary) for
every endpoint; `run_fuzz` sends them and tallies the answers. Plain HTTP and
hypothesis only, like the corpus (tests/reliability/adversarial.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from tests.reliability.adversarial import (
    BIG,
    CHAT,
    COMPLETIONS,
    MESSAGES,
    ODD_SESSION_IDS,
    PATHOLOGICAL_SCHEMAS,
    RESPONSES,
    Raw,
    Target,
    deep_schema,
    dumps,
    nested,
)

HUGE_SIZES = (256, 65_536, 1 << 20)
ODD_TEXT = ["", "\x00", "\ud800", "\ufeff", "<tool_call>{", "<|im_end|>", "\U0001f600" * 64, "\u202e", "{{ x }}",
            "{% for %}", "%s%n", "\r\n\r\n", "data: [DONE]\n\n"]

ints = st.integers(-BIG, BIG) | st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, BIG, -BIG])
floats = st.floats()  # NaN and the infinities included
small_text = st.text(max_size=40) | st.sampled_from(ODD_TEXT)


def long_text(*sizes: int) -> st.SearchStrategy[str]:
    """A few characters repeated to one of `sizes` (hypothesis cannot draw megabytes character by character)."""
    return st.tuples(st.text(min_size=1, max_size=3), st.sampled_from(sizes)).map(
        lambda t: (t[0] * (t[1] // len(t[0]) + 1))[:t[1]])


huge_text = long_text(*HUGE_SIZES)
texts = st.one_of(*[small_text] * 7, huge_text)  # huge ones cost the server a tokenization: 1 in 8
raw_json = (st.integers(1, 100_000).map(nested) | st.integers(1, 100_000).map(lambda d: nested(d, "dict"))
            | st.integers(4300, 50_000).map(lambda n: Raw("9" * n))
            | st.sampled_from([Raw("NaN"), Raw("-Infinity"), Raw("1e999"), Raw("-0"), Raw("1E-400")]))
scalars = st.none() | st.booleans() | ints | floats | small_text
anything = st.recursive(scalars | raw_json,
                        lambda c: st.lists(c, max_size=5) | st.dictionaries(small_text, c, max_size=5), max_leaves=12)
token_ids = st.integers(0, 20_000) | ints
# The corpus sends the schemas that take the compiler seconds; fuzzing keeps to the quick ones.
schema = anything | st.integers(1, 600).map(deep_schema) | st.sampled_from(
    [v for k, v in PATHOLOGICAL_SCHEMAS.items() if k not in ("enum of 20,000 values", "10,000 required properties")])
any_tool = st.fixed_dictionaries({"type": st.just("function") | anything, "function": st.fixed_dictionaries(
    {"name": small_text | anything}, optional={"description": texts, "parameters": schema})}) | anything
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
message = st.fixed_dictionaries({"role": roles | anything, "content": texts | anything},
                                optional={"tool_calls": anything, "tool_call_id": anything, "name": anything})
messages = st.lists(message, max_size=5) | anything | st.integers(0, 10_000).map(lambda n: [{"role": "user",
                                                                                             "content": "x"}] * n)
sampling = {"max_tokens": ints, "temperature": floats | anything, "top_p": floats, "top_k": ints, "seed": ints,
            "n": ints, "stop": st.lists(texts, max_size=6) | texts | anything, "stream": st.booleans() | anything,
            "logit_bias": st.dictionaries(token_ids.map(str) | small_text, floats | ints | anything, max_size=4),
            "stop_token_ids": st.lists(token_ids, max_size=4) | anything, "min_tokens": ints,
            "logprobs": st.booleans() | ints, "top_logprobs": ints, "session_id": texts | anything,
            "response_format": st.fixed_dictionaries({"type": st.sampled_from(["json_object", "json_schema", "text"])},
                                                     optional={"json_schema": st.fixed_dictionaries(
                                                         {"name": small_text, "schema": schema})}) | anything,
            "tools": st.lists(any_tool, max_size=3) | anything, "tool_choice": st.sampled_from(
                ["auto", "none", "required"]) | anything, "expected_wait_s": floats | ints,
            "priority": small_text | anything, "ignore_eos": st.booleans(), "presence_penalty": floats,
            "repetition_penalty": floats, "stream_options": anything, "max_completion_tokens": ints}
fuzz_bodies = {
    CHAT: st.fixed_dictionaries({"model": st.just("tiny") | anything, "messages": messages}, optional=sampling),
    COMPLETIONS: st.fixed_dictionaries({"model": st.just("tiny"), "prompt": texts | st.lists(token_ids, max_size=30)
                                        | anything}, optional=sampling),
    RESPONSES: st.fixed_dictionaries(
        {"model": st.just("tiny"), "input": texts | st.lists(message, max_size=3) | anything},
        optional={"max_output_tokens": ints, "seed": ints, "text": anything, "tools": st.lists(any_tool, max_size=2),
                  "previous_response_id": small_text, "stream": st.booleans(), "temperature": floats,
                  "top_logprobs": ints}),
    MESSAGES: st.fixed_dictionaries({"model": st.just("tiny"), "messages": messages, "max_tokens": ints},
                                    optional={"system": texts | anything, "stop_sequences": anything, "seed": ints,
                                              "stream": st.booleans(), "tools": anything, "tool_choice": anything}),
    "/v1/sessions": st.fixed_dictionaries({}, optional={"session_id": texts | anything}),
}


class FuzzRequest(NamedTuple):
    path: str
    content: bytes
    headers: dict[str, bytes]


@st.composite
def fuzz_requests(draw: st.DrawFn) -> FuzzRequest:
    """One request: a body around an endpoint's schema with values from their full ranges, or raw bytes."""
    path = draw(st.sampled_from([*fuzz_bodies, "/v1/messages/count_tokens", "/v1/sessions/x/fork"]))
    strategy = fuzz_bodies.get(path, fuzz_bodies[MESSAGES] if "count" in path else fuzz_bodies["/v1/sessions"])
    content = draw(st.one_of(strategy.map(dumps), strategy.map(dumps), strategy.map(dumps), anything.map(dumps),
                             st.binary(max_size=200)))
    headers = draw(st.fixed_dictionaries({}, optional={
        "X-Session-ID": (small_text | st.sampled_from(ODD_SESSION_IDS)).map(
            lambda s: s.encode("utf-8", "surrogatepass")),
        "X-Request-ID": st.binary(min_size=1, max_size=100),
        "Content-Type": st.sampled_from([b"application/json", b"text/plain", b"application/x-www-form-urlencoded"])}))
    return FuzzRequest(path, content, {k: v for k, v in headers.items() if is_sendable_header(v)})


def is_sendable_header(value: bytes) -> bool:
    """What an HTTP/1.1 client can put in a header value (no NUL, CR or LF; no space around it)."""
    return bool(value) and value == value.strip(b" \t") and all(c == 9 or 32 <= c != 127 for c in value)


@dataclass
class FuzzReport:
    num_sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)  # "200", "400", "timeout", "transport:<exc>"
    failures: list[str] = field(default_factory=list)  # the first 5xx and transport errors, with their request
    seconds: Counter[str] = field(default_factory=Counter)  # time spent waiting for answers, by status
    slowest: list[tuple[float, str]] = field(default_factory=list)  # the 10 slowest requests

    @property
    def num_5xx(self) -> int:
        return sum(n for s, n in self.statuses.items() if s[0] == "5")


# A request still running after this is given up on (and so aborted): one that may generate to the end of the
# context (a missing or clamped token cap) would hold a sender for many seconds.
FUZZ_TIMEOUT_S = 3.0
MAX_FAILURES_KEPT = 30


def run_fuzz(target: Target, num_requests: int, seed: int = 0, num_workers: int = 3) -> FuzzReport:
    """Send `num_requests` fuzzed requests, `num_workers` at a time; tally the answers."""
    report = FuzzReport()
    todo: queue.Queue[FuzzRequest | None] = queue.Queue(maxsize=4 * num_workers)
    lock = threading.Lock()

    def tally(key: str, req: FuzzRequest, detail: str, elapsed_s: float) -> None:
        with lock:
            report.num_sent += 1
            report.statuses[key] += 1
            report.seconds[key] += elapsed_s
            report.slowest = sorted([*report.slowest, (round(elapsed_s, 3), f"{key} {req.path} {req.content[:100]!r} "
                                                       f"({len(req.content)} bytes)")], reverse=True)[:10]
            if (key[0] == "5" or key.startswith("transport")) and len(report.failures) < MAX_FAILURES_KEPT:
                headers = {k: v[:40] for k, v in req.headers.items()}
                report.failures.append(f"{key} {req.path} {detail[:160]!r} <- {req.content[:160]!r} "
                                       f"({len(req.content)} bytes) {headers}")

    def send() -> None:
        with httpx.Client(base_url=target.url, timeout=FUZZ_TIMEOUT_S) as client:
            while (req := todo.get()) is not None:
                # A connection per request: a server that resets one after an error answers for that request only.
                headers = {"Authorization": f"Bearer {target.api_key}", "Content-Type": b"application/json",
                           "Connection": "close", **req.headers}
                t0 = time.perf_counter()
                try:
                    with client.stream("POST", req.path, content=req.content, headers=headers) as r:
                        chunks = []
                        for chunk in r.iter_bytes():  # a stream gets FUZZ_TIMEOUT_S in all, as a blocking call does
                            chunks.append(chunk)
                            if time.perf_counter() - t0 > FUZZ_TIMEOUT_S:
                                break
                    key, detail = str(r.status_code), b"".join(chunks).decode("utf-8", "replace")
                except httpx.TimeoutException:
                    key, detail = "timeout", ""
                except httpx.HTTPError as exc:
                    key, detail = f"transport:{type(exc).__name__}", str(exc)
                tally(key, req, detail, time.perf_counter() - t0)

    senders = [threading.Thread(target=send, daemon=True) for _ in range(num_workers)]
    for t in senders:
        t.start()

    @hypothesis_seed(seed)
    @settings(max_examples=num_requests, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(req=fuzz_requests())
    def produce(req: FuzzRequest) -> None:
        todo.put(req)

    try:
        produce()
    finally:
        for _ in senders:
            todo.put(None)
        for t in senders:
            t.join()
    return report
