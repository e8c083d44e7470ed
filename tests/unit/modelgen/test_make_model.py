"""Tests for the embedded default model builder (make_model, tokenizer_train, chat template).

Each tiny model is built once per module into a temp cache; the shared
tokenizer (the slow part, a few seconds) is trained once for all of them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors.torch import load_file
from tokenizers import Tokenizer

from sessionserve.modelgen import make_model as mm
from sessionserve.modelgen import tokenizer_train as tt

transformers = pytest.importorskip("transformers")

EXPECTED_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "generation_config.json"}
ADDED = (*tt.SPECIAL_TOKENS, *tt.TOOL_TOKENS)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("models")
    tt.ensure_tokenizer(cache)
    return cache


@pytest.fixture(scope="module")
def tiny(cache_dir: Path) -> dict[str, Path]:
    return {arch: mm.ensure_model(arch, "tiny", cache_dir) for arch in mm.ARCHS}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_unknown_arch_or_size_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        mm.make_model(tmp_path / "m", arch="gpt2", size="tiny", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="size"):
        mm.make_model(tmp_path / "m", arch="llama", size="huge", cache_dir=tmp_path)
    with pytest.raises(ValueError):
        mm.ensure_model("mistral", "tiny", tmp_path)
    assert not (tmp_path / "m").exists()


def test_default_model_dir(tmp_path: Path) -> None:
    assert mm.default_model_dir("qwen3", "tiny", tmp_path) == tmp_path / "qwen3-tiny"
    default = mm.default_model_dir()
    assert default == Path.home() / ".cache" / "sessionserve" / "models" / "llama-small"


def test_ensure_model_reuses_folder(tiny: dict[str, Path], cache_dir: Path) -> None:
    path = tiny["llama"]
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert mm.ensure_model("llama", "tiny", cache_dir) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before
    assert {p.name for p in path.iterdir()} == EXPECTED_FILES
    assert not list(cache_dir.glob(".*tmp-*")), "temp build dirs left behind"


@pytest.mark.parametrize("arch", mm.ARCHS)
def test_hf_loads_every_weight(tiny: dict[str, Path], arch: str) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tiny[arch], output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), f"{key}: {info.get(key)}"
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == mm.param_count(arch, "tiny")
    assert 2_000_000 <= n_params <= 6_000_000
    # The loaded tensors are the file's (catches a silently re-initialised bias/norm).
    state = load_file(str(tiny[arch] / "model.safetensors"))
    loaded = dict(model.named_parameters())
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    cfg = json.loads((tiny[arch] / "config.json").read_text())
    assert model.config.tie_word_embeddings == (arch != "llama")
    assert ("lm_head.weight" in state) == (arch == "llama")
    assert any(".q_proj.bias" in k for k in state) == (arch == "qwen2")
    assert any(".q_norm.weight" in k for k in state) == (arch == "qwen3")
    if arch == "llama":
        rope = getattr(model.config, "rope_parameters", None) or model.config.rope_scaling
        assert rope["rope_type"] == "llama3"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA exercised


@pytest.mark.parametrize("arch", mm.ARCHS)
def test_small_param_count_from_config(arch: str) -> None:
    assert 110_000_000 <= mm.param_count(arch, "small") <= 130_000_000


def test_same_seed_same_bytes(tmp_path: Path, cache_dir: Path) -> None:
    a = mm.make_model(tmp_path / "a", "qwen2", "tiny", seed=0, cache_dir=cache_dir)
    b = mm.make_model(tmp_path / "b", "qwen2", "tiny", seed=0, cache_dir=cache_dir)
    c = mm.make_model(tmp_path / "c", "qwen2", "tiny", seed=1, cache_dir=cache_dir)
    for name in EXPECTED_FILES:
        assert _sha(a / name) == _sha(b / name), name
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")


def test_rebuild_replaces_and_failed_build_leaves_nothing(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = mm.make_model(tmp_path / "m", "qwen3", "tiny", seed=0, cache_dir=cache_dir)
    first = _sha(out / "model.safetensors")
    mm.make_model(out, "qwen3", "tiny", seed=1, cache_dir=cache_dir)
    assert _sha(out / "model.safetensors") != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(mm, "save_file", crash)
    with pytest.raises(OSError):
        mm.make_model(tmp_path / "n", "qwen3", "tiny", cache_dir=cache_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_tokenizer_special_tokens_and_vocab(tiny: dict[str, Path]) -> None:
    raw = Tokenizer.from_file(str(tiny["llama"] / "tokenizer.json"))
    assert raw.get_vocab_size() == tt.VOCAB_SIZE
    for arch, path in tiny.items():
        tok = transformers.AutoTokenizer.from_pretrained(path)
        for t in ADDED:
            ids = tok.encode(t, add_special_tokens=False)
            assert ids == [raw.token_to_id(t)], (arch, t, ids)
        cfg = json.loads((path / "config.json").read_text())
        gen = json.loads((path / "generation_config.json").read_text())
        assert cfg["eos_token_id"] == tok.eos_token_id == raw.token_to_id("<|im_end|>")
        assert cfg["pad_token_id"] == tok.pad_token_id == raw.token_to_id("<|endoftext|>")
        assert gen["eos_token_id"] == [cfg["eos_token_id"], cfg["pad_token_id"]]
        assert cfg["bos_token_id"] is None and tok.bos_token is None


TEXTS = [
    "def f(x):\n    return x ** 2  # square\n\n\tindented   spaces  ",
    "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🙂👍, Ελληνικά, 12345.678",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{\"a\": 1}\n</tool_call> don't I'll",
]


def test_tokenizer_round_trip_and_loaders_agree(tiny: dict[str, Path]) -> None:
    raw = Tokenizer.from_file(str(tiny["llama"] / "tokenizer.json"))
    # transformers picks a different tokenizer class per model_type (Qwen2Tokenizer
    # for qwen2); all must give the ids of tokenizer.json itself.
    toks = {arch: transformers.AutoTokenizer.from_pretrained(p) for arch, p in tiny.items()}
    for text in TEXTS:
        ids = raw.encode(text).ids
        assert raw.decode(ids, skip_special_tokens=False) == text
        for arch, tok in toks.items():
            assert tok.encode(text, add_special_tokens=False) == ids, arch
            assert tok.decode(ids) == text, arch
    # Compression sanity: trained merges, not raw bytes.
    code = "import os\nfrom pathlib import Path\n\ndef main():\n    return None\n"
    assert len(raw.encode(code).ids) < len(code) / 2.5


def test_tokenizer_training_is_deterministic() -> None:
    files = tt.corpus_files(max_bytes=200_000)
    assert files == tt.corpus_files(max_bytes=200_000)
    a = tt.train_tokenizer(vocab_size=1024, files=files).to_str()
    b = tt.train_tokenizer(vocab_size=1024, files=files).to_str()
    assert a == b


def test_no_corpus_raises_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tt.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path), "purelib": str(tmp_path)})
    with pytest.raises(RuntimeError, match="no Python sources"):
        tt.corpus_files()


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris "},
                                 {"type": "text", "text": "and the time? <&>"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}},
        {"type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"CET\"}"}},
    ]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": [{"type": "text", "text": "12:00"}]},
    {"role": "assistant", "content": "It is 21 °C and noon."},
    {"role": "user", "content": "Thanks!"},
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather <now>",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                      "parameters": {"type": "object", "properties": {}}}},
]


def _render_plain(template: str, trim: bool, **kwargs: object) -> str:
    # What our server does: a plain sandboxed jinja2 env with a non-HTML-escaping tojson.
    env = ImmutableSandboxedEnvironment(trim_blocks=trim, lstrip_blocks=trim)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template).render(**kwargs)


def test_chat_template_hf_and_plain_jinja_agree(tiny: dict[str, Path]) -> None:
    template = mm.read_chat_template()
    tok = transformers.AutoTokenizer.from_pretrained(tiny["qwen3"])
    assert tok.chat_template == template
    cases = [
        dict(messages=CONVERSATION, tools=TOOLS, add_generation_prompt=True),
        dict(messages=CONVERSATION, tools=None, add_generation_prompt=False),
        dict(messages=[{"role": "user", "content": "hi"}], tools=None, add_generation_prompt=True),
    ]
    for case in cases:
        hf = tok.apply_chat_template(case["messages"], tools=case["tools"], tokenize=False,
                                     add_generation_prompt=case["add_generation_prompt"])
        for trim in (True, False):
            assert _render_plain(template, trim, **case) == hf
    with_tools = _render_plain(template, True, **cases[0])
    assert with_tools.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "\n<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" in with_tools
    assert ('<|im_start|>user\nWeather in Paris and the time? <&><|im_end|>\n<|im_start|>assistant\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>\n') in with_tools
    assert ("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n12:00\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\nIt is 21 °C and noon.<|im_end|>\n") in with_tools
    assert with_tools.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    assert _render_plain(template, True, **cases[2]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog.",
]


@pytest.mark.parametrize("arch", mm.ARCHS)
def test_logits_not_degenerate(tiny: dict[str, Path], arch: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny[arch]).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny[arch])
    continuations = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
            assert model(ids).logits[0, -1].std() > 0.5
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
            continuations.append(tuple(out[0, ids.shape[1]:].tolist()))
    assert len(set(continuations)) == len(PROMPTS), continuations
    assert all(len(set(c)) > 1 for c in continuations), continuations
    assert len({c[0] for c in continuations}) > 1, continuations
