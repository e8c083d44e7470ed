"""Continuing a stream on another replica: the rerun is cut to what the client has not seen, or refused."""

from __future__ import annotations

import json

import pytest

from sessionserve.router.resume import StreamDiverged, StreamLedger


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()) + b"\n\n"


def completion_stream(cid: str, pieces: list[tuple[str, list[int]]], usage: bool = True) -> list[bytes]:
    out = [sse({"id": cid, "created": 1, "choices": [{"index": 0, "text": t, "token_ids": ids, "finish_reason": None}]})
           for t, ids in pieces]
    out.append(sse({"id": cid, "created": 1, "choices": [{"index": 0, "text": "", "token_ids": [],
                                                          "finish_reason": "length"}]}))
    if usage:
        out.append(sse({"id": cid, "created": 1, "choices": [], "usage": {"completion_tokens": 6}}))
    return out + [sse("[DONE]")]


def chat_stream(cid: str, pieces: list[str]) -> list[bytes]:
    out = [sse({"id": cid, "created": 2, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    out += [sse({"id": cid, "created": 2, "choices": [{"index": 0, "delta": {"content": p}}]}) for p in pieces]
    out.append(sse({"id": cid, "created": 2, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    return out + [sse("[DONE]")]


def text_of(chunks: list[bytes]) -> tuple[str, list[int], set[str]]:
    text, ids, cids = "", [], set()
    for chunk in chunks:
        for event in chunk.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue
            obj = json.loads(event[6:])
            cids.add(obj["id"])
            for c in obj["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                ids += c.get("token_ids") or []
    return text, ids, cids


PIECES = [("Hel", [1]), ("lo", [2]), (" wor", [3]), ("ld", [4]), ("!", [5]), (" ok", [6])]


@pytest.mark.parametrize("cut", range(7))
def test_completion_stream_continues_where_it_stopped(cut: int) -> None:
    first = completion_stream("cmpl-a", PIECES)
    ledger = StreamLedger()
    delivered = first[:cut]
    for chunk in delivered:
        ledger.record(chunk)
    cont = ledger.continuation()
    # The rerun chunks its output differently (two tokens per event): the cut falls inside events.
    merged = [(PIECES[i][0] + PIECES[i + 1][0], PIECES[i][1] + PIECES[i + 1][1]) for i in range(0, 6, 2)]
    rest = [cont.filter(c) for c in completion_stream("cmpl-b", merged)]
    text, ids, cids = text_of(delivered + rest)
    assert text == "Hello world! ok" and ids == [1, 2, 3, 4, 5, 6]
    assert cids == {"cmpl-a"} or (cut == 0 and cids == {"cmpl-b"})
    tail = b"".join(rest)
    assert tail.endswith(b"data: [DONE]\n\n") and tail.count(b"[DONE]") == 1
    assert tail.count(b'"finish_reason": "length"') + tail.count(b'"finish_reason":"length"') == (cut < 7)


def test_chat_stream_continues_without_a_second_role_chunk() -> None:
    first = chat_stream("chatcmpl-a", ["The", " plan", " is", " ready."])
    ledger = StreamLedger()
    for chunk in first[:3]:  # role chunk, "The", " plan"
        ledger.record(chunk)
    cont = ledger.continuation()
    rest = b"".join(cont.filter(c) for c in chat_stream("chatcmpl-b", ["The plan", " is ready", "."]))
    assert b'"role"' not in rest
    text, _, cids = text_of(first[:3] + [rest])
    assert text == "The plan is ready." and cids == {"chatcmpl-a"}
    assert b'"finish_reason":"stop"' in rest and rest.endswith(b"data: [DONE]\n\n")


def test_a_rerun_that_differs_is_refused() -> None:
    ledger = StreamLedger()
    for chunk in completion_stream("a", PIECES)[:3]:
        ledger.record(chunk)
    cont = ledger.continuation()
    with pytest.raises(StreamDiverged):
        for chunk in completion_stream("b", [("Help", [1, 9])] + PIECES[2:]):
            cont.filter(chunk)


def test_tool_call_deltas_and_errors_make_a_stream_not_resumable() -> None:
    ledger = StreamLedger()
    ledger.record(sse({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "t"}]}}]}))
    assert not ledger.resumable
    ledger = StreamLedger()
    ledger.record(sse({"error": {"message": "boom"}}))
    assert not ledger.resumable


def test_events_split_across_chunks_are_reassembled() -> None:
    stream = b"".join(completion_stream("a", PIECES))
    ledger = StreamLedger()
    for i in range(0, 150, 7):  # delivered in 7-byte pieces
        ledger.record(stream[i:i + 7])
    cont = ledger.continuation()
    rerun = b"".join(completion_stream("b", PIECES))
    rest = b"".join(cont.filter(rerun[i:i + 5]) for i in range(0, len(rerun), 5))
    text, _, _ = text_of([stream[:ledger_cut(stream, 150)], rest])
    assert text == "Hello world! ok"


def ledger_cut(stream: bytes, n: int) -> int:
    """Bytes of complete events within the first `n` bytes (what the ledger counted as delivered)."""
    return stream[:n].rfind(b"\n\n") + 2
