"""Continuing a streamed reply on another replica after the first one died mid-stream.

The ingress records what a stream has delivered (`StreamLedger.record`: per
choice, the text and the token ids sent). When the replica dies, it sends the
same request to another replica and passes that reply through
`Continuation.filter`, which drops what the client already has and keeps the
rest, under the original completion id. The turn is computed again from its
start (with the KV store folder, only the turn itself: its history's KV is
read back), so the client sees one uninterrupted stream.

This holds only if the second run produces what the first one sent, which
greedy decoding, or sampling with a seed, does. The filter checks it: the
skipped part must equal what was delivered, else `StreamDiverged` (the ingress
then ends the stream with an error event, as it does for a stream it cannot
continue at all: one that sent tool-call deltas, which are not replayed).
Pure: bytes in, bytes out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DONE = b"data: [DONE]"


class StreamDiverged(Exception):
    """The second run's output does not start with what the first one delivered."""


def _events(buffer: bytearray, chunk: bytes) -> list[bytes]:
    """Complete SSE events (without their blank-line terminator) from `buffer` + `chunk`; keeps the rest."""
    buffer += chunk
    out = []
    while (end := buffer.find(b"\n\n")) >= 0:
        out.append(bytes(buffer[:end]))
        del buffer[:end + 2]
    return out


def _payload(event: bytes) -> dict[str, Any] | None:
    """The JSON object of a `data:` event, or None ([DONE], comments, anything else)."""
    if not event.startswith(b"data:") or event.strip() == DONE:
        return None
    try:
        obj = json.loads(event[5:])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _content(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


@dataclass
class StreamLedger:
    """What a stream has delivered so far, per choice index."""

    text: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    completion_id: str | None = None
    created: int | None = None
    finished: bool = False  # a finish_reason went out: only [DONE] may be missing
    resumable: bool = True
    _buffer: bytearray = field(default_factory=bytearray)

    def record(self, chunk: bytes) -> None:
        for event in _events(self._buffer, chunk):
            obj = _payload(event)
            if obj is None:
                continue
            if "error" in obj:
                self.resumable = False
            self.completion_id = self.completion_id or obj.get("id")
            self.created = self.created or obj.get("created")
            for choice in obj.get("choices") or ():
                i = choice.get("index", 0)
                delta = choice.get("delta")
                if isinstance(delta, dict) and delta.get("tool_calls"):
                    self.resumable = False  # streamed tool-call fragments are not matched on a rerun
                self.text[i] = self.text.get(i, "") + _content(choice)
                if choice.get("token_ids"):
                    self.token_ids.setdefault(i, []).extend(choice["token_ids"])
                if choice.get("finish_reason"):
                    self.finished = True

    def continuation(self) -> Continuation:
        return Continuation({i: t for i, t in self.text.items()}, {i: list(t) for i, t in self.token_ids.items()},
                            self.completion_id, self.created, self.finished)


@dataclass
class Continuation:
    """Filters a rerun's stream down to what follows the delivered part."""

    text: dict[int, str]  # delivered, still to be matched and dropped
    token_ids: dict[int, list[int]]
    completion_id: str | None
    created: int | None
    finished: bool
    _buffer: bytearray = field(default_factory=bytearray)

    def filter(self, chunk: bytes) -> bytes:
        """The part of `chunk` the client has not seen, as SSE bytes (maybe empty). Raises StreamDiverged."""
        out = []
        for event in _events(self._buffer, chunk):
            obj = _payload(event)
            if obj is None:
                out.append(event + b"\n\n")
                continue
            if "error" in obj:
                out.append(event + b"\n\n")
                continue
            if self.finished and obj.get("choices"):
                continue  # all of it was delivered; only [DONE] is still owed
            kept = [c for c in (self._trim(c) for c in obj.get("choices") or ()) if c is not None]
            if not kept and obj.get("choices"):
                continue
            obj["choices"] = kept
            if self.completion_id is not None:
                obj["id"] = self.completion_id
            if self.created is not None:
                obj["created"] = self.created
            out.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
        return b"".join(out)

    def _trim(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        """The choice with its delivered prefix cut off; None if nothing of it is new."""
        i = choice.get("index", 0)
        delta = choice.get("delta")
        is_chat = isinstance(delta, dict)
        content = _content(choice)
        owed = self.text.get(i, "")
        if owed:
            n = min(len(owed), len(content))
            if content[:n] != owed[:n]:
                raise StreamDiverged(f"choice {i}: rerun sent {content[:n]!r} where {owed[:n]!r} was delivered")
            self.text[i], content = owed[n:], content[n:]
        ids = choice.get("token_ids")
        owed_ids = self.token_ids.get(i, [])
        if ids and owed_ids:
            n = min(len(owed_ids), len(ids))
            if ids[:n] != owed_ids[:n]:
                raise StreamDiverged(f"choice {i}: rerun token ids differ from the delivered ones")
            self.token_ids[i], ids = owed_ids[n:], ids[n:]
        if is_chat:  # the opening role chunk went out before any output: never again
            rest = {k: v for k, v in delta.items() if k not in ("content", "role")}
            if content:
                rest["content"] = content
            new = {**choice, "delta": rest}
            has_news = bool(rest)
        else:
            new = {**choice, "text": content}
            has_news = bool(content)
        if ids is not None:
            new["token_ids"] = ids
            has_news = has_news or bool(ids)
        return new if has_news or choice.get("finish_reason") else None
