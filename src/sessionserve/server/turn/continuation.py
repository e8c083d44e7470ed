"""Continue a session: send the engine only what the session does not hold yet.

After each turn the server remembers where the session's conversation left
off (`Transcripts`): the session's point (its token count and turn number)
and a digest of the conversation it holds, i.e. the messages that made the
prompt and the reply as it was returned (its text and tool calls in canonical
form: JSON arguments compare by value, so a client that re-encodes them with
other spacing or key order still matches). A request that extends that
conversation is then planned as a *splice*: the session's tokens, the model's
own reply among them, plus the tokens of the text that follows the reply
(render.continuation_text). A previous_response_id names the point directly.

When nothing matches (the client rewrote the history, or the server restarted)
the whole conversation is rendered and tokenized, and the session is cut back
to the longest common prefix of its tokens and the prompt (`continue_session`),
never past it. Each way is counted.

Planning runs off the engine thread (tokenizing is the costly part); whether a
splice still applies is checked in the engine thread, right before the turn is
added, against the session as it is then.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sessionserve.server.bridge import SessionBusyError, SessionState
from sessionserve.server.turn.render import continuation_text, render_chat
from sessionserve.server.turn.types import Continuation, SessionPoint, ToolCall

if TYPE_CHECKING:
    from sessionserve.llm_engine import LLMEngine
    from sessionserve.model.tokenizer import Tokenizer

MAX_TRANSCRIPTS = 20_000  # sessions whose latest point is remembered per engine (least recently used go first)
FORK_MARK = "~"  # forked and implicit session ids start with a character client-chosen ids cannot contain


class NeedFullPrompt(Exception):
    """The planned splice no longer applies (the session moved on): plan with the whole prompt."""


# -- canonical conversation ------------------------------------------------------------------------


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _canonical_args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
    return arguments


def canonical_message(message: dict[str, Any]) -> str:
    """The message as compared between turns: what the template renders, tool arguments by value."""
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role == "assistant":
        calls = []
        for tc in message.get("tool_calls") or ():
            fn = tc.get("function", tc)
            calls.append([fn.get("name"), _canonical_args(fn.get("arguments"))])
        body: list[Any] = [role, _text(message.get("content")).strip(), calls]
    else:
        body = [role, _text(message.get("content")), message.get("tool_call_id"), message.get("name")]
    return json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _chain(prev: str, part: str) -> str:
    return hashlib.blake2b(f"{prev}\x00{part}".encode(), digest_size=16).hexdigest()


def conversation_digests(tools: list[dict[str, Any]] | None, messages: Sequence[dict[str, Any]]) -> list[str]:
    """Digests of every prefix of `messages` (with the tools): entry i covers messages[:i]."""
    specs = [t.get("function", t) for t in tools or ()]
    out = [_chain("tools", json.dumps(specs, sort_keys=True, ensure_ascii=False))]
    for m in messages:
        out.append(extend_digest(out[-1], m))
    return out


def extend_digest(digest: str, message: dict[str, Any]) -> str:
    """The digest of a conversation with `digest` once `message` is added to it."""
    return _chain(digest, canonical_message(message))


def reply_message(content: str | None, tool_calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The assistant message a finished turn returned, chat-shaped."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = [{"id": c.call_id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in tool_calls]
    return msg


def tokens_digest(token_ids: Sequence[int]) -> str:
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


# -- where conversations left off -------------------------------------------------------------------


class Transcripts:
    """Where each conversation of one engine's sessions left off: by conversation digest, the point that holds
    it; by session, its latest points (a retried or branched turn continues an earlier one, as a fork).

    Thread-safe: written on the event loop, forgotten from the engine thread when a session closes.
    Bounded: the least recently used sessions go first, and each keeps its last `points_per_session`
    points; an entry that no longer matches its session is caught by the engine-thread check and costs a
    full render, nothing else.
    """

    def __init__(self, max_sessions: int = MAX_TRANSCRIPTS, points_per_session: int = 8) -> None:
        self.max_sessions = max_sessions
        self.points_per_session = points_per_session
        self._lock = threading.Lock()
        self._by_key: OrderedDict[str, tuple[str, list[Continuation]]] = OrderedDict()  # key -> (tenant, oldest first)
        self._by_digest: dict[tuple[str, str], Continuation] = {}  # (tenant, digest) -> where it is held

    def __len__(self) -> int:
        return len(self._by_key)

    def latest(self, key: str) -> Continuation | None:
        entry = self._by_key.get(key)
        return entry[1][-1] if entry is not None else None

    def find(self, tenant: str, digest: str) -> Continuation | None:
        return self._by_digest.get((tenant, digest))

    def record(self, tenant: str, cont: Continuation) -> None:
        key = cont.point.key
        with self._lock:
            _, points = self._by_key.pop(key, (tenant, []))
            points.append(cont)
            while len(points) > self.points_per_session:
                self._drop_digest(tenant, points.pop(0))
            self._by_key[key] = (tenant, points)
            self._by_digest[(tenant, cont.digest)] = cont
            while len(self._by_key) > self.max_sessions:
                self._forget(next(iter(self._by_key)))

    def forget(self, key: str) -> None:
        with self._lock:
            self._forget(key)

    def _forget(self, key: str) -> None:
        entry = self._by_key.pop(key, None)
        if entry is not None:
            for cont in entry[1]:
                self._drop_digest(entry[0], cont)

    def _drop_digest(self, tenant: str, cont: Continuation) -> None:
        if self._by_digest.get((tenant, cont.digest)) is cont:
            del self._by_digest[(tenant, cont.digest)]


# -- planning ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Splice:
    """Continue the session at `point` with `delta` (the tokens after its reply)."""

    point: SessionPoint
    delta: list[int]


@dataclass
class PromptPlan:
    """What to send for a chat-shaped turn: a splice when a held conversation matches, else the whole prompt."""

    splice: Splice | None
    full: list[int] | None
    digest: str  # digest of the whole conversation the prompt renders (recorded with the reply)

    @property
    def num_prompt_tokens(self) -> int:
        if self.splice is not None:
            return self.splice.point.end + len(self.splice.delta)
        assert self.full is not None
        return len(self.full)


def held_point(digests: list[str], messages: Sequence[dict[str, Any]], transcripts: Transcripts, tenant: str,
               key: str | None, previous: Continuation | None) -> tuple[int, Continuation] | None:
    """(number of messages a session holds, its continuation) for the longest held prefix of `messages`.

    `previous`: the point a stored response names (its digest must match the same prefix); `key`: the
    session the client named (only its own points count); neither: any session of the tenant.
    """
    for n in range(len(messages), 0, -1):
        if messages[n - 1].get("role") != "assistant":
            continue
        d = digests[n]
        if previous is not None:
            if previous.digest == d:
                return n, previous
            continue
        cont = transcripts.find(tenant, d)
        if cont is not None and (key is None or cont.point.key == key):
            return n, cont
    return None


def plan_prompt(tok: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                held: tuple[int, Continuation] | None, digests: list[str], want_full: bool) -> PromptPlan:
    """Runs in the tokenize pool: the splice for `held` if the template allows, else (or also, with
    `want_full`) the whole prompt's tokens."""
    splice = None
    if held is not None:
        n, cont = held
        point = cont.point
        text = continuation_text(tok, messages[:n], messages[n:], tools, point.stop_text, point.stopped) \
            if point.stop_text and n < len(messages) else None
        if text:
            splice = Splice(cont.point, tok.encode(text, add_special_tokens=False))
    full = render_chat(tok, messages, tools) if splice is None or want_full else None
    return PromptPlan(splice, full, digests[-1])


# -- in the engine thread ---------------------------------------------------------------------------


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def continue_session(eng: LLMEngine, session_id: str, prompt: list[int], tenant: str,
                     priority: str = "interactive") -> tuple[list[int], int]:
    """Prepare `session_id` (opened on first use) for a turn whose whole prompt is `prompt`.

    Runs in the engine thread. The session is cut back to the longest common prefix of its tokens and the
    prompt. Returns (new tokens to send, tokens reused).
    """
    session = eng.get_session(session_id)
    if session is None:
        eng.open_session(session_id, tenant=tenant, priority=priority)
        return prompt, 0
    if session.tenant != tenant:
        raise PermissionError("session belongs to another tenant")
    history = session.token_ids
    lcp = common_prefix_len(history, prompt)
    if lcp == len(prompt):
        lcp -= 1  # at least one token must be computed to get logits for the next one
    if lcp < len(history):
        eng.sessions.truncate(session, lcp)
    return prompt[lcp:], lcp


def new_fork_id() -> str:
    return f"{FORK_MARK}{uuid.uuid4().hex[:20]}"


def try_splice(eng: LLMEngine, splice: Splice, tenant: str, may_fork: bool,
               in_place: bool) -> tuple[str, list[int]] | None:
    """In the engine thread: (session key, new tokens) if the session still holds `splice.point`; the turn
    runs in that session if `in_place` and it is idle there, else (if `may_fork`) in a fork of it at the
    point. None when the session no longer holds it."""
    point = splice.point
    session = eng.get_session(point.key)
    if session is None or session.tenant != tenant or not splice.delta:
        return None
    at_point = len(session.token_ids) == point.end and session.stats.num_turns == point.num_turns
    if in_place and at_point and session.state is not SessionState.RUNNING:
        return point.key, splice.delta
    if not may_fork:
        if at_point:
            raise SessionBusyError(f"session {point.key.split('/', 1)[-1]!r} already has a turn running")
        return None
    if len(session.token_ids) < point.end or tokens_digest(session.token_ids[:point.end]) != point.tokens_digest:
        return None
    child = f"{tenant}/{new_fork_id()}"
    eng.fork_session(point.key, child)
    forked = eng.get_session(child)
    assert forked is not None
    forked.token_ids = forked.token_ids[:point.end]
    return child, splice.delta


def point_after(eng: LLMEngine, key: str, stop_token_ids: Sequence[int], is_whole_reply: bool) -> SessionPoint | None:
    """In the engine thread, after a turn: the session's point now (None if it is gone or running again).

    `is_whole_reply`: the session's tokens are the reply as returned (not so after a tool call was cut
    off: its markup is in the tokens and not in the reply).
    """
    session = eng.get_session(key)
    if session is None or session.state is SessionState.RUNNING or not session.token_ids:
        return None
    last = session.token_ids[-1]
    closing = eng.tokenizer.eos_token  # the token the chat template closes a reply with
    stopped = last in stop_token_ids
    stop_text = eng.tokenizer.decode([last], skip_special_tokens=False) if stopped else closing
    if stopped and closing and stop_text != closing and session.num_computed_tokens < len(session.token_ids):
        # It stopped on another stop token (e.g. <|endoftext|>), which the template never renders: drop it
        # (its KV was never computed) and continue as after a cut reply, with the template's closing.
        eng.sessions.truncate(session, len(session.token_ids) - 1)
        stopped, stop_text = False, closing
    return SessionPoint(key, len(session.token_ids), session.stats.num_turns, tokens_digest(session.token_ids),
                        stop_text if is_whole_reply else None, stopped)
