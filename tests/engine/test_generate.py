"""End-to-end generation on tiny models: exactness, batching, preemption, stops and cleanup."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sessionserve import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (n,), generator=g).tolist()
    return [torch.randint(50, 16000, (n_,), generator=g).tolist() for n_ in lengths]


def hf_generate(path: Path, prompt: list[int], n: int) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_clean(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not kv.block_tables and not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(model=str(tiny_llama), num_blocks=128, block_size=16, max_num_batched_tokens=256)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_batched_greedy_equals_hf_and_unbatched(tiny_models: dict[str, Path], arch: str) -> None:
    path = tiny_models[arch]
    ps = prompts(6, seed=1)
    llm = LLM(model=str(path), num_blocks=128, max_num_batched_tokens=64)  # forces chunked prefill
    batched = [o.token_ids for o in llm.generate(ps, GREEDY)]
    single = [llm.generate([p], GREEDY)[0].token_ids for p in ps]
    assert batched == single
    for p, got in list(zip(ps, batched))[:3]:
        assert got == hf_generate(path, p, GREEDY.max_tokens)
    assert_clean(llm)


def test_preemption_keeps_outputs_exact(tiny_llama: Path) -> None:
    ps = prompts(8, seed=2)
    roomy = LLM(model=str(tiny_llama), num_blocks=256)
    tight = LLM(model=str(tiny_llama), num_blocks=14, block_size=16, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in roomy.generate(ps, params)]
    got = [o.token_ids for o in tight.generate(ps, params)]
    assert got == want
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert_clean(tight)


def test_abort_mid_generation_frees_blocks(llm: LLM) -> None:
    eng = llm.engine
    ids = [eng.add_request(p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)) for p in prompts(4, 3)]
    eng.step()
    eng.step()
    assert eng.kv.num_free_blocks < eng.kv.pool.num_blocks
    for rid in ids:
        assert eng.abort(rid)
    assert not eng.abort(ids[0])
    assert_clean(llm)


def test_penalties_survive_preemption_and_leave_no_state(tiny_llama: Path) -> None:
    ps = prompts(8, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True, repetition_penalty=1.5,
                            frequency_penalty=0.5)
    roomy = LLM(model=str(tiny_llama), num_blocks=256)
    tight = LLM(model=str(tiny_llama), num_blocks=14, block_size=16, enable_prefix_caching=False)
    want = [o.token_ids for o in roomy.generate(ps, params)]
    assert [o.token_ids for o in tight.generate(ps, params)] == want  # recomputed outputs still count
    assert tight.engine.core.scheduler.num_preemptions > 0
    eng = tight.engine
    ids = [eng.add_request(p, params) for p in ps[:2]]
    eng.step()
    for rid in ids:
        assert eng.abort(rid)
    eng.add_request(ps[2], GREEDY)
    eng.step()  # the aborted requests' per-request sampling state goes with the next step
    runner = eng.runner
    assert not runner._prompt_ids and not runner._generators
    while eng.has_unfinished():
        eng.step()
    assert_clean(tight)


def test_prefix_cache_reuses_blocks_across_requests(llm: LLM) -> None:
    shared = prompts(1, 4)[0] * 3  # > 2 blocks
    a = llm.generate([shared + [11, 12]], GREEDY)[0]
    b = llm.generate([shared + [13, 14]], GREEDY)[0]
    assert a.num_cached_tokens == 0 or a.num_cached_tokens < len(shared)
    assert b.num_cached_tokens >= (len(shared) // 16) * 16 - 16
    assert b.num_cached_tokens > 0
    # Cached or not, greedy output is the same.
    llm.engine.kv.pool.reset_prefix_cache()
    assert llm.generate([shared + [13, 14]], GREEDY)[0].token_ids == b.token_ids
    assert_clean(llm)


def test_stop_strings_and_stop_tokens(llm: LLM) -> None:
    p = prompts(1, 5)[0]
    free = llm.generate([p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop_tok = free.token_ids[5]
    by_token = llm.generate([p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                stop_token_ids=[stop_tok]))[0]
    first = free.token_ids.index(stop_tok)
    assert by_token.token_ids == free.token_ids[: first + 1]
    assert by_token.finish_reason == "stop" and by_token.outputs[0].stop_reason == stop_tok
    text = free.text
    needle = text[len(text) // 2: len(text) // 2 + 3]
    if needle.strip():
        by_str = llm.generate([p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[needle]))[0]
        assert by_str.finish_reason == "stop"
        assert by_str.text == text[: text.index(needle)]
    assert_clean(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    ps = prompts(3, 6)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    alone = llm.generate([ps[0]], params)[0].token_ids
    together = llm.generate(ps, [params, SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True),
                                 SamplingParams(max_tokens=3, temperature=0)])[0].token_ids
    assert alone == together
    other = llm.generate([ps[0]], SamplingParams(max_tokens=10, temperature=0.9, seed=124, ignore_eos=True))
    assert other[0].token_ids != alone


def test_logprobs_are_the_model_distribution(llm: LLM, tiny_llama: Path) -> None:
    p = prompts(1, 7)[0]
    out = llm.generate([p], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=4))[0]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 3
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), -1)
    first = lps[0]
    assert out.token_ids[0] in first and len(first) == 4  # greedy choice is also the top-1
    for tok, lp in first.items():
        assert abs(lp - ref[tok].item()) < 1e-4


def test_each_output_keeps_the_logprobs_of_its_own_tokens(llm: LLM) -> None:
    """A streamed output is read after later steps ran: its rows must not grow with the sequence."""
    engine = llm.engine
    engine.add_request(prompts(1, 9)[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert len(outputs) == 5
    for out in outputs:
        rows = out.outputs[0].logprobs
        assert rows is not None and len(rows) == len(out.token_ids)
        assert all(tok in row for tok, row in zip(out.token_ids, rows))


def test_min_tokens_and_eos(llm: LLM) -> None:
    eos = llm.engine.core.eos_token_ids[0]
    # logit_bias makes EOS the greedy choice; min_tokens holds it back.
    params = SamplingParams(max_tokens=10, temperature=0, min_tokens=4, logit_bias={eos: 100.0})
    out = llm.generate([prompts(1, 8)[0]], params)[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and out.finish_reason == "stop"


def hf_greedy_with_penalties(path: Path, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding on HF's logits with OpenAI's penalties over the generated tokens, one token at a time."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            out.append(int((logits - frequency * counts - presence * (counts > 0).float()).argmax()))
    return out


def test_penalties_equal_their_reference_on_hf_logits(tiny_llama: Path, llm: LLM) -> None:
    ps = prompts(3, seed=5)
    rep = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    greedy = [o.token_ids for o in llm.generate(ps, GREEDY)]
    rep_outs = llm.generate(ps, rep)
    assert [o.token_ids for o in rep_outs] != greedy  # the penalty changes what greedy picks on this model
    for p, got in zip(ps, rep_outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               repetition_penalty=1.8)[0, len(p):].tolist()
        assert got.token_ids == want
    pf = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5)
    outs = llm.generate(ps, pf)
    for p, got in zip(ps, outs):
        assert got.token_ids == hf_greedy_with_penalties(tiny_llama, p, 12, 1.5, 0.5)
    assert [o.token_ids for o in outs] != greedy
    assert_clean(llm)


def test_context_length_limit(tiny_llama: Path) -> None:
    small = LLM(model=str(tiny_llama), num_blocks=64, max_model_len=32)
    out = small.generate([list(range(100, 125))], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 32
    with pytest.raises(ValueError, match="context"):
        small.generate([list(range(100, 140))], GREEDY)
    assert_clean(small)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}, {"logprobs": 50},
    {"min_tokens": 5, "max_tokens": 2}, {"stop": [""]},
])
def test_bad_sampling_params_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="invalid sampling parameter"):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_leave_nothing_behind(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 10**9]], GREEDY)
    with pytest.raises(ValueError):
        llm.generate([[1, 2], [3, -1]], GREEDY)
    assert_clean(llm)


def test_text_prompts_and_chat(llm: LLM) -> None:
    out = llm.generate("def parse_config(path):", SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("def parse_config(path):")
    assert len(out.token_ids) <= 8 and isinstance(out.text, str)
    reply = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4, temperature=0))
    assert reply.finish_reason in ("stop", "length")


def test_bounded_prefill_beside_decodes_gives_the_same_tokens(tiny_llama: Path) -> None:
    """`max_prefill_step_s` only splits a prompt that arrives while others decode into smaller chunks: greedy
    output is the same, and that prompt took more steps to its first token."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    short, long = prompts(2), prompts(1, seed=1)[0] * 8

    def run(**options: float) -> tuple[list[list[int]], int]:
        llm = LLM(str(tiny_llama), num_blocks=256, max_num_batched_tokens=512, **options)
        eng = llm.engine
        rids = [eng.add_request(p, params) for p in short]
        eng.step()
        eng.step()  # both decode now
        eng.core.prefill_s_per_token = 1.0  # as measured: with 1e-6 s a step, the bound is one block
        rids.append(eng.add_request(long, params))
        done: dict[str, list[int]] = {}
        steps_to_first = 0
        while eng.has_unfinished():
            steps_to_first += rids[2] not in done and not eng.core.requests[rids[2]].output_token_ids
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        assert_clean(llm)
        return [done[r] for r in rids], steps_to_first

    plain, plain_steps = run()
    bounded, bounded_steps = run(max_prefill_step_s=1e-6)
    assert plain == bounded
    assert bounded_steps >= len(long) // 16 > plain_steps, (bounded_steps, plain_steps)
