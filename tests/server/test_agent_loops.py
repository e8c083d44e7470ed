"""A 4-turn tool loop through each protocol: every turn computes only its new items.

The model's reply of one turn comes back in the next as the client re-encodes it (tool arguments with
another key order and spacing); the session holds the reply's own tokens, so the next prompt reuses all
of them: cached = the previous prompt + the previous reply - 1 (the reply's last token, whose KV the
engine computes with the next turn), and the prompt tokens computed are the new items alone.
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai

from tests.server.conftest import LiveServer

ENUM = ["ls", "pwd", "make test"]
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "run", "description": "Run a command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string", "enum": ENUM}}, "required": ["cmd"]}}}]
RESPONSES_TOOLS = [{"type": "function", **CHAT_TOOLS[0]["function"]}]
MESSAGES_TOOLS = [{"name": "run", "description": "Run a command",
                   "input_schema": CHAT_TOOLS[0]["function"]["parameters"]}]
NUM_TURNS = 4


def reencode(arguments: str) -> str:
    """Arguments as another JSON library writes them: sorted keys, other spacing."""
    return json.dumps(json.loads(arguments), sort_keys=True, indent=2)


def computed_tokens(server: LiveServer) -> int:
    """Prompt tokens the server computed so far (received minus cached), from /metrics."""
    text = httpx.get(server.url + "/metrics").text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf'^{name}_total{{model="tiny"}} (\S+)$', text, re.M))

    return int(total("sessionserve_prompt_tokens") - total("sessionserve_cached_prompt_tokens"))


def check_loop(usages: list[tuple[int, int, int]], computed_by_metrics: int) -> None:
    """usages: (prompt, cached, output) per turn."""
    assert len(usages) == NUM_TURNS
    for (prompt, _, output), (next_prompt, next_cached, _) in zip(usages, usages[1:]):
        assert next_cached == prompt + output - 1, usages  # nothing the session held was computed again
        assert next_prompt - next_cached < 40, usages  # only the tool result and the headers around it
    assert computed_by_metrics == sum(p - c for p, c, _ in usages)


def test_chat_completions_loop(server: LiveServer) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="key-alice", max_retries=0)
    msgs = [{"role": "system", "content": "You run commands."}, {"role": "user", "content": "Check the build."}]
    before, usages = computed_tokens(server), []
    for turn in range(NUM_TURNS):
        last = turn == NUM_TURNS - 1
        r = c.chat.completions.create(model="tiny", messages=msgs, tools=CHAT_TOOLS, temperature=0,
                                      tool_choice="auto" if last else "required", max_tokens=12 if last else 200,
                                      extra_headers={"X-Session-ID": "loop-chat"})
        usages.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens, r.usage.completion_tokens))
        if last:
            break
        call = r.choices[0].message.tool_calls[0]
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": reencode(call.function.arguments)}}]})
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": f"output {turn}"})
    check_loop(usages, computed_tokens(server) - before)


def _responses_turn(c: openai.OpenAI, last: bool, **kw: object) -> openai.types.responses.Response:
    return c.responses.create(model="tiny", tools=RESPONSES_TOOLS, temperature=0,
                              tool_choice="auto" if last else "required", max_output_tokens=16 if last else 200, **kw)


def test_responses_loop_with_previous_response_id(server: LiveServer) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="key-alice", max_retries=0)
    before, usages, previous, items = computed_tokens(server), [], None, "Check the build."
    for turn in range(NUM_TURNS):
        last = turn == NUM_TURNS - 1
        r = _responses_turn(c, last, input=items, instructions="You run commands.",
                            **({"previous_response_id": previous} if previous else {}))
        usages.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens))
        call = next(o for o in r.output if o.type == "function_call") if not last else None
        previous = r.id
        items = [{"type": "function_call_output", "call_id": call.call_id, "output": f"output {turn}"}] if call else []
    check_loop(usages, computed_tokens(server) - before)


def test_responses_loop_store_false_full_history(server: LiveServer) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="key-alice", max_retries=0)
    history: list = [{"type": "message", "role": "developer", "content": "You run commands."},
                     {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Check it."}]}]
    before, usages = computed_tokens(server), []
    for turn in range(NUM_TURNS):
        last = turn == NUM_TURNS - 1
        r = _responses_turn(c, last, input=history, store=False, prompt_cache_key="loop-codex-thread")
        usages.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens))
        if last:
            break
        call = next(o for o in r.output if o.type == "function_call")
        history += [{"type": "function_call", "id": call.id, "call_id": call.call_id, "name": call.name,
                     "arguments": reencode(call.arguments), "status": "completed"},
                    {"type": "function_call_output", "call_id": call.call_id, "output": f"output {turn}"}]
    check_loop(usages, computed_tokens(server) - before)


def test_messages_loop(server: LiveServer) -> None:
    c = anthropic.Anthropic(base_url=server.url, api_key="key-alice", max_retries=0)
    msgs: list = [{"role": "user", "content": "Check the build."}]
    headers = {"X-Claude-Code-Session-Id": "loop-claude"}
    before, usages = computed_tokens(server), []
    for turn in range(NUM_TURNS):
        last = turn == NUM_TURNS - 1
        m = c.messages.create(model="tiny", system="You run commands.", messages=msgs, tools=MESSAGES_TOOLS,
                              tool_choice={"type": "auto" if last else "any"}, max_tokens=12 if last else 200,
                              extra_body={"temperature": 0}, extra_headers=headers)
        u = m.usage
        usages.append((u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens, u.output_tokens))
        if last:
            break
        use = next(b for b in m.content if b.type == "tool_use")
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": f"output {turn}"}]})
    check_loop(usages, computed_tokens(server) - before)


def test_a_reply_that_stops_on_another_stop_token_is_continued_exactly(server: LiveServer) -> None:
    """The embedded model also stops on <|endoftext|>, which its template never renders (it closes replies
    with <|im_end|>): the next turn still reuses everything the session computed."""
    end = server.engine.tokenizer.token_to_id("<|endoftext|>")
    assert end in server.engine.core.eos_token_ids
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="key-alice", max_retries=0)
    msgs = [{"role": "user", "content": "Stop at once."}]
    headers = {"X-Session-ID": "loop-endoftext"}
    first = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, logit_bias={str(end): 100},
                                      extra_headers=headers)
    assert first.usage.completion_tokens == 1 and first.choices[0].finish_reason == "stop"
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Go on."}]
    second = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, extra_headers=headers)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
