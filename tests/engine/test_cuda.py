"""The engine on CUDA: same logits as Hugging Face on the GPU, and a clean pool after generation.

Skipped without a CUDA device; `bench/gpu.sh` runs these on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sessionserve import LLM, SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_on_cuda_matches_hf_fp32(tiny_models: dict[str, Path], arch: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    path = tiny_models[arch]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(50, 16000, (n,), generator=g).tolist() for n in (5, 33, 70)]
    llm = LLM(model=str(path), device="cuda", dtype="float32", num_blocks=64)
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=10, min_new_tokens=10,
                              do_sample=False)[0, len(p):].tolist()
        assert got == ref
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_bf16_generation_runs_and_frees(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), device="cuda", dtype="bfloat16", num_blocks=64, max_num_batched_tokens=32)
    outs = llm.generate([[100 + i] * (10 + i) for i in range(8)],
                        SamplingParams(max_tokens=20, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(o.token_ids) == 20 for o in outs)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks
