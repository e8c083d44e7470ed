"""Structured outputs end to end on the tiny random-weight llama: its raw output is gibberish,
so every valid JSON / tool call here is the grammar's doing. Tool calls in each family's format, read
back by that family's parser. Also the compiler's mask details."""

from __future__ import annotations

import os
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sessionserve import LLM, SamplingParams
from sessionserve.model.structured import GrammarCompiler, apply_constraints
from sessionserve.server.turn.tool_calls import parse_output
from sessionserve.types.guided import GuidedDecoding, ToolFormat

# Bounded strings and integers: random weights otherwise write unbounded strings and digits.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
}, "required": ["name", "age", "color", "tags"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"name": "add", "parameters": ADD}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
PROMPTS = ["Hello, give me JSON", "The weather in Paris is", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
           "x y z", "def f(x):", "1 2 3"]
SAMPLINGS = [dict(temperature=0.0), dict(temperature=1.0, seed=7)]
BLOCK = re.compile(r'<tool_call>\n(\{.*?\})\n</tool_call>', re.S)


# A Mistral v11-style template: the model's own tool format is `[TOOL_CALLS]name[ARGS]{...}`.
MISTRAL_ARGS_TEMPLATE = ("{% for m in messages %}[INST]{{ m.content }}[/INST]{% for c in m.tool_calls | default([]) %}"
                         "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}"
                         "{% endfor %}")


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(model=str(tiny_llama), num_blocks=128)


@pytest.fixture(scope="module")
def tiny_mistral(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with a Mistral v11-style template and `[TOOL_CALLS]` / `[ARGS]` as special tokens
    (in place of two of its added tokens)."""
    path = tmp_path_factory.mktemp("tiny-mistral")
    for f in tiny_llama.iterdir():
        shutil.copy(f, path / f.name)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    renamed = {"<tool_response>": "[TOOL_CALLS]", "</tool_response>": "[ARGS]"}
    for token in tokenizer["added_tokens"]:
        if token["content"] in renamed:
            token["content"], token["special"] = renamed[token["content"]], True
    vocab = tokenizer["model"]["vocab"]
    for old, new in renamed.items():
        if old in vocab:
            vocab[new] = vocab.pop(old)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = MISTRAL_ARGS_TEMPLATE
    config.pop("added_tokens_decoder", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def check_schema(value: Any, schema: dict[str, Any]) -> None:
    """Validate the schema subset used here (strict: no undeclared properties)."""
    if "enum" in schema:
        assert value in schema["enum"]
    elif schema["type"] == "object":
        assert isinstance(value, dict) and set(value) <= set(schema["properties"])
        assert set(schema.get("required", [])) <= set(value)
        for key, item in value.items():
            check_schema(item, schema["properties"][key])
    elif schema["type"] == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
        for item in value:
            check_schema(item, schema["items"])
    elif schema["type"] == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    elif schema["type"] == "integer":
        assert isinstance(value, int) and schema.get("minimum", value) <= value <= schema.get("maximum", value)


def body(llm: LLM, out: Any) -> str:
    """Output text without its final EOS; asserts the request ended on EOS, not on length."""
    assert out.finish_reason == "stop", llm.tokenizer.decode(out.token_ids, skip_special_tokens=False)
    assert out.token_ids[-1] in llm.engine.runner.arch.eos_token_ids
    return llm.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=False)


def parse_tool_calls(llm: LLM, out: Any) -> list[dict[str, Any]]:
    text, pos, calls = body(llm, out), 0, []
    while True:
        m = BLOCK.match(text, pos)
        assert m is not None, text
        calls.append(json.loads(m.group(1)))
        pos = m.end()
        if pos == len(text):
            break
        assert text[pos] == "\n", text
        pos += 1
    # The markers are emitted as their single added tokens, not spelled out.
    begin_id = llm.tokenizer.token_to_id("<tool_call>")
    assert out.token_ids.count(begin_id) == len(calls)
    for call in calls:
        assert set(call) == {"name", "arguments"}
        check_schema(call["arguments"], SCHEMAS[call["name"]])
    return calls


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_json_object(llm: LLM, sampling: dict[str, Any]) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=120, guided=GuidedDecoding.json_object(), **sampling))
    compiler = llm.engine.runner._grammar_compiler
    assert compiler is not None
    for out in outs:
        # Every token the engine sampled is one the grammar allows (a fresh matcher replays them).
        replay = compiler.constraint(GuidedDecoding.json_object())
        assert all(replay.accept(t) for t in out.token_ids)
        if out.finish_reason == "stop":
            assert isinstance(json.loads(body(llm, out)), dict)
    # Random weights often write a key that never ends (hits max_tokens): only some close.
    assert any(o.finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_json_schema(llm: LLM, sampling: dict[str, Any]) -> None:
    params = SamplingParams(max_tokens=200, guided=GuidedDecoding.json_schema(PERSON), logprobs=0, **sampling)
    for out in llm.generate(PROMPTS, params):
        check_schema(json.loads(body(llm, out)), PERSON)
        # Logprobs stay those of the unmasked model: finite for every chosen token.
        assert all(torch.isfinite(torch.tensor(list(lp.values()))).all() for lp in out.outputs[0].logprobs)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_tool_calls_required(llm: LLM, sampling: dict[str, Any]) -> None:
    params = SamplingParams(max_tokens=200, guided=GuidedDecoding.tool_calls(TOOLS), **sampling)
    for out in llm.generate(PROMPTS, params):
        assert len(parse_tool_calls(llm, out)) >= 1


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_tool_calls_named_single(llm: LLM, sampling: dict[str, Any]) -> None:
    guided = GuidedDecoding.tool_calls(TOOLS, name="add", parallel=False)
    for out in llm.generate(PROMPTS, SamplingParams(max_tokens=200, guided=guided, **sampling)):
        assert [c["name"] for c in parse_tool_calls(llm, out)] == ["add"]


def check_calls(llm: LLM, out: Any, fmt: ToolFormat, names: list[str] | None = None) -> None:
    """The output's text (as the engine streams it) holds nothing but calls in `fmt`, each matching its
    tool's schema; the last one may be cut when the output ran to its token limit, else it ended on EOS."""
    if out.finish_reason != "length":
        body(llm, out)
    text = out.text
    content, calls, cut = parse_output(text, set(SCHEMAS), fmt)
    assert content is None and calls and (out.finish_reason == "length" or not cut), text
    assert names is None or [c.name for c in calls] == names
    for call in calls:
        check_schema(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("fmt", [ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL, ToolFormat.MISTRAL_ARGS])
def test_tool_calls_in_each_format(llm: LLM, fmt: ToolFormat) -> None:
    # Random weights go on calling in parallel until the token limit; one call ends on EOS.
    parallel = SamplingParams(max_tokens=100, temperature=1.0, seed=3,
                              guided=GuidedDecoding.tool_calls(TOOLS, format=fmt))
    for out in llm.generate(PROMPTS[:2], parallel):
        check_calls(llm, out, fmt)
    single = SamplingParams(max_tokens=200, temperature=0, guided=GuidedDecoding.tool_calls(TOOLS, "add", False, fmt))
    for out in llm.generate(PROMPTS[:2], single):
        assert out.finish_reason == "stop"
        check_calls(llm, out, fmt, ["add"])


def test_tool_calls_in_the_models_format_with_special_markers(tiny_mistral: Path) -> None:
    llm = LLM(model=str(tiny_mistral), num_blocks=32)
    assert llm.tokenizer.tool_format is ToolFormat.MISTRAL_ARGS
    marker = llm.tokenizer.token_to_id("[TOOL_CALLS]")
    params = [SamplingParams(max_tokens=200, temperature=t, seed=5, guided=GuidedDecoding.tool_calls(TOOLS))
              for t in (0.0, 1.0)]
    for out in llm.generate(PROMPTS[:2], params):
        assert out.token_ids.count(marker) >= 1  # the marker token, not its spelling
        check_calls(llm, out, ToolFormat.MISTRAL_ARGS)  # the engine's text keeps the special markers


def test_mixed_batch_leaves_unconstrained_rows_alone(llm: LLM) -> None:
    plain = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)]
    guided = [SamplingParams(max_tokens=200, temperature=0, guided=GuidedDecoding.tool_calls(TOOLS)),
              SamplingParams(max_tokens=200, temperature=1.0, seed=5, guided=GuidedDecoding.json_schema(PERSON))]
    params = [guided[0], plain[0], guided[1], plain[1]]
    together = llm.generate(PROMPTS[:4], params)
    alone = [llm.generate([p], sp)[0] for p, sp in zip(PROMPTS[:4], params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    parse_tool_calls(llm, together[0])
    check_schema(json.loads(body(llm, together[2])), PERSON)


def test_constraint_state_survives_preemption(llm: LLM, tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=200, temperature=0, guided=GuidedDecoding.tool_calls(TOOLS))
    prompts = [p + " and more words to fill a block" * 3 for p in PROMPTS]
    want = [o.token_ids for o in llm.generate(prompts, params)]
    tight = LLM(model=str(tiny_llama), num_blocks=14, block_size=16, enable_prefix_caching=False)
    outs = tight.generate(prompts, params)
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == want
    for out in outs:
        parse_tool_calls(tight, out)


def allowed(mask_logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(mask_logits).nonzero().flatten().tolist())


def test_markers_stay_out_of_strings_and_stops_follow_termination(tiny_llama: Path) -> None:
    compiler = GrammarCompiler(tiny_llama)
    begin, end = (compiler._single_token(m) for m in ("<tool_call>", "</tool_call>"))
    text = '\n{"name": "get_weather", "arguments": {"city": "'
    c = compiler.constraint(GuidedDecoding.tool_calls(TOOLS))
    logits = torch.zeros(1, compiler.vocab_size)
    apply_constraints(logits, [c])
    assert allowed(logits[0]) == {begin}  # a call must open with the marker token itself
    assert c.accept(begin) and all(c.accept(t) for t in compiler._tok.encode(text).ids)
    logits.zero_()
    apply_constraints(logits, [c])
    inside = allowed(logits[0])
    assert len(inside) > 1000 and begin not in inside and end not in inside
    close = compiler._tok.encode('x", "unit": "c"}}\n').ids
    assert all(c.accept(t) for t in close)
    logits.zero_()
    apply_constraints(logits, [c])
    assert allowed(logits[0]) == {end}
    assert c.accept(end) and c.accept(compiler.stop_token_ids[0]) and c.is_terminated
    logits = torch.zeros(2, compiler.vocab_size)
    apply_constraints(logits, [c, None])
    assert allowed(logits[0]) == set(compiler.stop_token_ids) and allowed(logits[1]) == set(range(compiler.vocab_size))
    # A request's own stop ids end the grammar too.
    own = compiler.constraint(GuidedDecoding.json_object(), stop_token_ids=(7,))
    assert all(own.accept(t) for t in compiler._tok.encode("{}").ids)
    logits = torch.zeros(1, compiler.vocab_size)
    apply_constraints(logits, [own])
    assert allowed(logits[0]) == {7, *compiler.stop_token_ids}
    # Both tools are reachable under "required"; a wrong name is not.
    for name in ("add", "get_weather"):
        r = compiler.constraint(GuidedDecoding.tool_calls(TOOLS))
        assert r.accept(begin) and all(r.accept(t) for t in compiler._tok.encode(f'\n{{"name": "{name}"').ids)
    r = compiler.constraint(GuidedDecoding.tool_calls(TOOLS))
    assert r.accept(begin) and not all(r.accept(t) for t in compiler._tok.encode('\n{"name": "mul"').ids)


def test_special_markers_only_where_the_grammar_wants_them(tiny_mistral: Path) -> None:
    compiler = GrammarCompiler(tiny_mistral)
    marker, args = compiler._single_token("[TOOL_CALLS]"), compiler._single_token("[ARGS]")
    assert compiler.tool_format is ToolFormat.MISTRAL_ARGS and marker is not None and args is not None
    c = compiler.constraint(GuidedDecoding.tool_calls(TOOLS))
    logits = torch.zeros(1, compiler.vocab_size)
    apply_constraints(logits, [c])
    assert allowed(logits[0]) == {marker}
    assert c.accept(marker) and all(c.accept(t) for t in compiler._tok.encode("get_weather").ids)
    logits.zero_()
    apply_constraints(logits, [c])
    assert allowed(logits[0]) == {args}
    assert c.accept(args) and all(c.accept(t) for t in compiler._tok.encode('{"city": "').ids)
    logits.zero_()
    apply_constraints(logits, [c])
    assert len(allowed(logits[0])) > 1000 and marker not in allowed(logits[0])  # not inside a string
    assert all(c.accept(t) for t in compiler._tok.encode('x", "unit": "c"}').ids)
    logits.zero_()
    apply_constraints(logits, [c])
    assert allowed(logits[0]) == {marker, *compiler.stop_token_ids}  # another call, or the end
    # A JSON answer never holds the marker token either.
    j = compiler.constraint(GuidedDecoding.json_schema({"type": "string"}))
    assert j.accept(compiler._tok.token_to_id('"'))
    logits.zero_()
    apply_constraints(logits, [j])
    assert len(allowed(logits[0])) > 1000 and marker not in allowed(logits[0])


def test_padded_model_vocab_is_masked_and_bad_specs_raise(tiny_llama: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_llama / name, tmp_path / name)
    config = json.loads((tiny_llama / "config.json").read_text())
    tokenizer_vocab = config["vocab_size"]
    config["vocab_size"] = tokenizer_vocab + 64  # lm_head padded past the tokenizer
    (tmp_path / "config.json").write_text(json.dumps(config))
    compiler = GrammarCompiler(tmp_path)
    logits = torch.zeros(2, tokenizer_vocab + 64)
    apply_constraints(logits, [None, compiler.constraint(GuidedDecoding.json_object())])
    assert allowed(logits[1]) and max(allowed(logits[1])) < tokenizer_vocab
    assert torch.isfinite(logits[0]).all()
    g = GuidedDecoding.json_schema(PERSON)
    assert compiler.compile(g) is compiler.compile(GuidedDecoding.json_schema(dict(PERSON)))
    # JSON strings hold no raw control characters, bounded-length ones included.
    short = compiler.constraint(GuidedDecoding.json_schema({"type": "string", "maxLength": 5}))
    assert short.accept(compiler._tok.token_to_id('"')) and not short.accept(compiler._tok.encode("\t").ids[0])
    pattern = compiler.constraint(GuidedDecoding.json_schema({"type": "string", "pattern": "^a.c$"}))
    assert all(pattern.accept(t) for t in compiler._tok.encode('"abc"').ids)
    with pytest.raises(ValueError):
        compiler.compile(GuidedDecoding.json_schema({"type": "no-such-type"}))
    with pytest.raises(ValueError):
        compiler.compile(GuidedDecoding.tool_calls([{"name": "f", "parameters": {"type": "no-such-type"}}]))


def test_a_grammar_that_compiles_too_large_is_refused_by_the_compiler_child(tiny_llama: Path) -> None:
    """The child answers with the compiled size, and past the size bound with an error for the request."""
    import socket
    import threading
    from multiprocessing.connection import Connection

    from sessionserve.model import grammar_worker

    ours, theirs = socket.socketpair()
    child = threading.Thread(target=grammar_worker._serve, args=(Connection(theirs.detach()), str(tiny_llama), None),
                             kwargs={"max_bytes": 64 * 1024}, daemon=True)
    child.start()
    conn = Connection(ours.detach())
    assert conn.recv() == "ready"
    small = GuidedDecoding.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    conn.send(small)
    ok, size = conn.recv()
    assert ok and 0 < size <= 64 * 1024
    many = GuidedDecoding.json_schema({"type": "object", "properties": {"v": {"enum": [f"v{i}" for i in range(3000)]}},
                                       "required": ["v"]})
    conn.send(many)
    ok, message = conn.recv()
    assert not ok, len(message)
    assert "MiB allowed" in message, message
    conn.close()
    child.join(10)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priority is Linux's")
def test_compile_threads_run_below_the_server_and_leave_its_priority_alone(tiny_llama: Path) -> None:
    """A compile the child passed runs again in the server on a thread at the lowest priority: the same grammar,
    while the calling thread (an engine or event-loop thread) keeps the server's."""
    import threading

    from sessionserve.model.grammar_worker import COMPILE_NICENESS, lower_thread_priority

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []

    def probe() -> None:
        lower_thread_priority()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen == [max(before, COMPILE_NICENESS)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    compiler = GrammarCompiler(tiny_llama)
    compiler.use_worker(30.0)
    try:
        g = GuidedDecoding.json_schema(PERSON)
        compiled = compiler.compile(g)
        assert compiler.compile(g) is compiled  # cached
        assert compiled.memory_size_bytes == GrammarCompiler(tiny_llama)._compile(g).memory_size_bytes
        with pytest.raises(ValueError):
            compiler.compile(GuidedDecoding.json_schema({"type": "no-such-type"}))
    finally:
        compiler.close()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_check_that_finds_every_compiler_busy_is_a_retry_not_a_refusal(tiny_llama: Path) -> None:
    """One child, busy with a slow schema: a second request waits at most the limit for it, then gets
    GrammarBusy (the server's 429), which is not remembered against its spec."""
    import threading
    import time

    from sessionserve.model.grammar_worker import GrammarBusy, GrammarTimeout, GrammarWorker

    worker = GrammarWorker(tiny_llama, None, timeout_s=1.0, num_children=1)
    slow = GuidedDecoding.json_schema({"type": "object", "properties": {
        "v": {"enum": [f"value-{i}" for i in range(20_000)]}}, "required": ["v"]})
    small = GuidedDecoding.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    try:
        assert worker.check(small) > 0  # the child is up
        outcome: list[BaseException] = []
        first = threading.Thread(target=lambda: outcome.append(pytest.raises(GrammarTimeout, worker.check, slow).value))
        first.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        with pytest.raises(GrammarBusy):
            worker.check(small)
        assert time.monotonic() - t0 < 3.0 and worker.num_busy == 1
        first.join(30)
        assert outcome and isinstance(outcome[0], GrammarTimeout)
        deadline = time.monotonic() + 60
        while True:  # the stopped child starts again (seconds: it imports torch); then small compiles
            try:
                assert worker.check(small) > 0
                break
            except GrammarBusy:
                assert time.monotonic() < deadline
    finally:
        worker.close()


def test_every_compiler_busy_is_a_429_with_retry_after() -> None:
    import asyncio
    from types import SimpleNamespace

    from sessionserve.model.grammar_worker import GrammarBusy
    from sessionserve.server import protocol as P
    from sessionserve.server.turn.generate import compile_guided

    class Busy:
        def use_worker(self, timeout_s: float) -> None:
            pass

        def compile(self, guided: GuidedDecoding) -> None:
            raise GrammarBusy("every grammar compiler was busy for 5 s; retry shortly")

    slot = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(grammar_compiler=Busy())))
    with pytest.raises(P.OpenAIError) as caught:
        asyncio.run(compile_guided(slot, GuidedDecoding.json_object()))  # type: ignore[arg-type]
    assert (caught.value.status_code, caught.value.code, caught.value.retry_after_s) == (
        429, "grammar_compilers_busy", 1.0)
