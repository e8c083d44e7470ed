"""Run a turn on an engine: per-tenant limits, the bridge, retries while a session's KV moves, disconnects.

`start_generation` adds one request and returns its outputs. Its `prepare`
callable runs in the engine thread right before the request is added (it
works out the session and the new tokens there); a session whose KV is being
copied between tiers refuses the turn for a moment, and the turn is added
again until `MOVE_WAIT_S` has passed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import Request

from sessionserve.server import protocol as P
from sessionserve.server.app import engine_error
from sessionserve.server.auth import tenant_salt
from sessionserve.server.bridge import GrammarBusy, OutputStream, SessionMovingError, Turn
from sessionserve.server.turn.continuation import NeedFullPrompt
from sessionserve.types.guided import GuidedDecoding
from sessionserve.types.sampling_params import SamplingParams
from sessionserve.types.sequence import ParkHint

if TYPE_CHECKING:
    from sessionserve.llm_engine import LLMEngine
    from sessionserve.server.app import ModelSlot, ServerState
    from sessionserve.server.turn.types import TurnRequest

# How long a turn waits for its session's KV to finish moving between tiers. A move ends (done, or failed
# and the session recomputes) in well under this even behind a queue of disk writes; a turn waits for it
# rather than failing, and only a tier that stopped answering makes it a 409.
MOVE_WAIT_S = 120.0
# How long a request's grammar (response format, forced tool calls) may take to compile before a 400.
GRAMMAR_TIMEOUT_S = 5.0


def check_in_flight(state: ServerState, tenant: str) -> None:
    """429 when `tenant` already has its limit of generation requests in flight."""
    if state.in_flight.get(tenant, 0) >= state.config.max_requests_per_tenant:
        raise P.OpenAIError(429, f"Too many requests in flight for this API key (limit "
                                 f"{state.config.max_requests_per_tenant}).", "rate_limit_error", code="too_many_requests")


def check_prompt_size(turn: TurnRequest, eng: LLMEngine) -> None:
    """A 400 for a prompt whose text alone is too long for the context, before anything renders or tokenizes
    it: its characters bound its tokens from below (Tokenizer.max_token_chars), so a huge body costs a
    count, not seconds of tokenization."""
    chars = _text_chars([turn.prompt, turn.conversation, turn.tools])
    at_least = chars // eng.tokenizer.max_token_chars
    if at_least >= eng.max_model_len:
        raise P.OpenAIError(400, f"This model's maximum context length is {eng.max_model_len} tokens; the "
                                 f"prompt has at least {at_least} tokens ({chars} characters).",
                            "invalid_request_error", param="prompt" if turn.messages is None else "messages",
                            code="context_length_exceeded")


def _text_chars(value: object) -> int:
    """Characters in the strings of a JSON-like value (keys included), without recursion."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def make_params(sampling: dict, max_tokens: int | None, num_prompt: int, eng: LLMEngine, clamp: bool = False,
                **extra: object) -> SamplingParams:
    """SamplingParams for a prompt of `num_prompt` tokens; a 400 when it or the output cap does not fit."""
    room = eng.max_model_len - num_prompt
    if room < 1:
        raise P.OpenAIError(400, f"This model's maximum context length is {eng.max_model_len} tokens; the "
                                 f"prompt has {num_prompt} tokens.", "invalid_request_error", param="messages",
                            code="context_length_exceeded")
    if max_tokens is None or (clamp and max_tokens > room):
        max_tokens = room
    if max_tokens > room:
        raise P.OpenAIError(400, f"max_tokens is {max_tokens}, but the prompt has {num_prompt} tokens and the "
                                 f"context is {eng.max_model_len}.", "invalid_request_error", param="max_tokens",
                            code="context_length_exceeded")
    min_tokens = sampling.get("min_tokens", 0)
    if min_tokens > max_tokens:
        raise P.bad_request(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}).", "min_tokens")
    try:
        params = SamplingParams(**sampling, max_tokens=max_tokens, **extra)
        params.check_vocab(eng.runner.arch.vocab_size)
        return params
    except ValueError as exc:
        raise P.OpenAIError(400, str(exc), "invalid_request_error") from None


async def compile_guided(slot: ModelSlot, guided: GuidedDecoding) -> None:
    """Compile the request's grammar before the engine takes it: in a child process stopped past
    GRAMMAR_TIMEOUT_S, awaited off the event loop and the engine thread (which then finds it cached).
    A bad spec, or one too slow to compile, is the request's 400; compilers all busy with others' grammars
    past the limit, a 429 to retry."""
    compiler = slot.engine.runner.grammar_compiler
    compiler.use_worker(GRAMMAR_TIMEOUT_S)
    try:
        await asyncio.to_thread(compiler.compile, guided)
    except ValueError as exc:
        raise P.bad_request(str(exc), "tools" if guided.kind == "tool_calls" else "response_format") from None
    except GrammarBusy as exc:
        raise P.OpenAIError(429, str(exc), "rate_limit_error", code="grammar_compilers_busy",
                            retry_after_s=1.0) from None


async def start_generation(state: ServerState, request: Request, slot: ModelSlot,
                           prepare: Callable[[LLMEngine], Turn], params: SamplingParams,
                           priority: str | None, park_hint: ParkHint | None = None) -> OutputStream:
    """Add the request to the engine; its outputs follow. Counted against the tenant's in-flight limit until
    the stream ends. Raises NeedFullPrompt (from `prepare`, before anything ran) for the caller to plan again.
    """
    tenant = request.state.tenant
    check_in_flight(state, tenant)
    state.in_flight[tenant] = state.in_flight.get(tenant, 0) + 1

    def release() -> None:
        state.in_flight[tenant] -= 1
        if not state.in_flight[tenant]:
            del state.in_flight[tenant]

    deadline = time.monotonic() + MOVE_WAIT_S
    try:
        while True:
            try:
                outputs = await slot.bridge.submit(prepare, params, engine_request_id(request),
                                                  salt=tenant_salt(tenant), priority=priority, park_hint=park_hint)
                break
            except SessionMovingError as exc:
                # Raised while adding the turn, before any output: wait out the copy and add it again.
                if time.monotonic() > deadline:
                    raise engine_error(exc) from exc
                await asyncio.sleep(0.01)
            except (P.OpenAIError, NeedFullPrompt):
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
                raise engine_error(exc) from exc
    except BaseException:
        release()
        raise
    outputs.on_end(release)
    return outputs


def engine_request_id(request: Request) -> str:
    """The engine's id for the request: the client's X-Request-ID within its tenant's namespace."""
    return getattr(request.state, "engine_request_id", None) or request.state.request_id


def guided_decoding(turn: TurnRequest) -> GuidedDecoding | None:
    """The output constraint a turn asks for, if any.

    tool_choice "required" or naming a function constrains the output to tool calls. With tools offered
    (tool_choice auto) and a response format, the output is either tool calls or an answer in that format
    (one grammar for both: OpenAI applies the format to the final answer). A response format alone
    constrains the answer.
    """
    choice = turn.tool_choice
    forced = turn.tools and (choice == "required" or isinstance(choice, dict))
    if forced or (turn.uses_tools and turn.response_format is not None):
        name = choice.get("name") if isinstance(choice, dict) else None
        try:
            return GuidedDecoding.tool_calls(turn.tools or [], name, parallel=turn.parallel_tool_calls,
                                             answer=None if forced else turn.response_format)
        except ValueError as exc:
            raise P.bad_request(f"Invalid tools: {exc}", "tools") from None
    if turn.uses_tools:
        return None
    return turn.response_format


async def until_disconnected(request: Request) -> None:
    """Returns once the client has hung up."""
    # NOTE: a waiting task, not `request.is_disconnected()`: that polls receive() under a cancelled
    # scope, which through the HTTP middleware's task group never sees the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
