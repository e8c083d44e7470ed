"""The real executor: turns a scheduler plan into one forward pass and samples next tokens."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sessionserve.config import CacheConfig, ModelConfig
from sessionserve.model import paged_kernel, tile_attention
from sessionserve.model.attention import (
    GATHER_MIN_ROWS,
    AttentionCaps,
    AttentionMetadata,
    AttentionPath,
    TileBatchBuilder,
    attention_path,
    context_mask,
    mask_bias,
    pad_tables,
    uses_flash_attention,
)
from sessionserve.model.decoder import DecoderModel
from sessionserve.model.hf_config import ModelArch, load_arch
from sessionserve.model.loader import load_weights
from sessionserve.model.packed_linear import pack_linears, packing_supported
from sessionserve.model.sampler import SampleRow, sample, top_logprobs, verify_sampled
from sessionserve.types.executor import ExecutorOutput
from sessionserve.types.scheduler_output import SchedulerOutput
from sessionserve.types.sequence import Sequence

if TYPE_CHECKING:  # xgrammar takes seconds to import: loaded on the first guided request
    from sessionserve.model.structured import Constraint, GrammarCompiler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str = "float32") -> torch.dtype:
    """The compute dtype for `name`; "auto" follows the checkpoint where the device runs it fast.

    CUDA: bfloat16. CPU: bfloat16 for half-precision checkpoints when the CPU
    has native bf16 dot products (AVX-512 BF16 / AMX), else float32; a float32
    checkpoint stays float32.
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if checkpoint_dtype in ("bfloat16", "float16") and cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN reports native bf16 support on this CPU."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class ModelRunner:
    """Owns the weights and the device-tier KV tensors; implements `Executor`."""

    def __init__(self, model_dir: str | Path, model_config: ModelConfig, cache_config: CacheConfig,
                 max_model_len: int | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.arch: ModelArch = load_arch(model_dir)
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device, self.arch.torch_dtype)
        if model_config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(model_config.num_threads)
        self.max_model_len = min(max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        self.block_size = cache_config.block_size
        with torch.device(self.device):
            model = DecoderModel(self.arch, self.max_model_len)
        load_weights(model, model_dir)
        self.model = model.to(self.dtype).eval()
        self.model.rope.to(torch.float32)  # cos/sin tables stay fp32, as in HF
        self.packed = model_config.pack_weights and packing_supported(self.device, self.dtype)
        if self.packed:
            pack_linears(self.model)

        dtype_bytes = torch.finfo(self.dtype).bits // 8
        self.block_bytes = self.arch.kv_bytes_per_token(dtype_bytes) * self.block_size
        self.num_blocks = cache_config.num_blocks or max(1, cache_config.kv_cache_bytes // self.block_bytes)
        shape = (self.num_blocks, self.arch.num_kv_heads, self.block_size, self.arch.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.arch.num_layers)]
        self.use_kernel = (self.device.type == "cpu" and paged_kernel.available()
                           and paged_kernel.supports(self.arch.num_heads, self.arch.num_kv_heads, self.arch.head_dim))
        self.use_tiles = (self.device.type == "cpu" and self.dtype == torch.bfloat16 and tile_attention.available()
                          and tile_attention.supports_shape(self.arch.head_dim))
        self.flash_attention = uses_flash_attention(self.device, self.dtype, self.use_tiles)  # prefills: flash
        self.gather_min_rows = GATHER_MIN_ROWS  # context chunks this long gather (when not flash)
        self._generators: dict[str, tuple[Sequence, torch.Generator]] = {}
        self._prompt_ids: dict[str, tuple[Sequence, torch.Tensor]] = {}  # repetition_penalty's prompt token sets
        self._default_generator = torch.Generator(device=self.device)
        self._default_generator.manual_seed(model_config.seed)
        # Structured outputs: compiler built on first guided request; matcher state per request id.
        self._grammar_compiler: GrammarCompiler | None = None
        self._constraints: dict[str, tuple[Sequence, Constraint]] = {}
        logger.info("loaded %s (%.1fM params) on %s/%s, %d KV blocks of %d tokens, paged kernel %s, "
                    "prefill attention %s, packed weights %s",
                    self.arch.architecture, self.arch.num_params() / 1e6, self.device, self.dtype,
                    self.num_blocks, self.block_size, "on" if self.use_kernel else "off",
                    "flash" if self.flash_attention else "tiles" if self.use_tiles else "SDPA",
                    "on" if self.packed else "off")

    @property
    def attention_caps(self) -> AttentionCaps:
        return AttentionCaps(tiles=self.use_tiles, flash=self.flash_attention, paged_kernel=self.use_kernel,
                             gather_min_rows=self.gather_min_rows)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        for per_request in (self._generators, self._prompt_ids, self._constraints):
            if per_request:  # a finished or aborted request's state (and its Sequence) goes now, not on a later miss
                _drop_finished(per_request)
        input_ids, positions, meta, logits_rows, sampled_seqs = self.prepare_batch(plan)
        all_logits = self.model(input_ids, positions, self.kv_caches, meta, logits_rows)  # (S + spec rows, V)
        logits = all_logits[:len(sampled_seqs)]
        sampled, accepted = self._verify_drafts(plan, all_logits[len(sampled_seqs):])
        if sampled_seqs:
            normal = self._sample(logits, sampled_seqs)
            sampled.update(normal.sampled)
            return ExecutorOutput(sampled, normal.logprobs, accepted)
        return ExecutorOutput(sampled, {}, accepted)

    def forward_logits(self, plan: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits (S, V) of the plan's sampling chunks, no sampling (a drafter samples its own way)."""
        with torch.inference_mode():
            input_ids, positions, meta, logits_rows, sampled_seqs = self.prepare_batch(plan)
            return self.model(input_ids, positions, self.kv_caches, meta, logits_rows), sampled_seqs

    def _verify_drafts(self, plan: SchedulerOutput, logits: torch.Tensor) -> tuple[
            dict[str, int], dict[str, list[int]]]:
        """For each chunk with proposed tokens: the accepted prefix and the target's next token.

        `logits` holds 1 + num_spec rows per such chunk, in plan order.
        """
        sampled: dict[str, int] = {}
        accepted: dict[str, list[int]] = {}
        if logits.shape[0] == 0:
            return sampled, accepted
        greedy_ids = logits.argmax(dim=-1).tolist()
        row = 0
        for chunk in plan.chunks:
            if not chunk.num_spec:
                continue
            seq, k = chunk.seq, chunk.num_spec
            drafts = seq.spec_token_ids[:k]
            rows = logits[row:row + k + 1]
            if seq.sampling_params.is_greedy:
                targets = greedy_ids[row:row + k + 1]
                a = 0
                while a < k and drafts[a] == targets[a]:
                    a += 1
                keep, token = drafts[:a], targets[a]
            else:
                probs = seq.spec_probs[:k] if isinstance(seq.spec_probs, torch.Tensor) else None
                keep, token = verify_sampled(rows, drafts, probs, self._sample_row(seq))
            accepted[seq.request_id] = keep
            sampled[seq.request_id] = token
            row += k + 1
        return sampled, accepted

    def _sample(self, logits: torch.Tensor, sampled_seqs: list[Sequence]) -> ExecutorOutput:
        want = [i for i, seq in enumerate(sampled_seqs) if seq.sampling_params.logprobs is not None]
        sample_logits, constraints = logits, None
        if any(seq.sampling_params.guided is not None for seq in sampled_seqs):
            from sessionserve.model.structured import apply_constraints
            constraints = [self._constraint(seq) for seq in sampled_seqs]
            if want:
                sample_logits = logits.clone()  # logprobs stay those of the raw model
            apply_constraints(sample_logits, constraints)
        rows = [self._sample_row(seq) for seq in sampled_seqs]
        own = sample_logits is not logits or not want  # logprobs need the raw logits: edit a copy then
        tokens = sample(sample_logits, rows, in_place=own).tolist()
        if constraints is not None:
            for constraint, tok in zip(constraints, tokens):
                if constraint is not None:
                    constraint.accept(tok)
        sampled = {seq.request_id: tok for seq, tok in zip(sampled_seqs, tokens)}
        logprobs: dict[str, dict[int, float]] = {}
        if want:
            num = max(sampled_seqs[i].sampling_params.logprobs or 0 for i in want)
            idx = torch.tensor(want, device=logits.device)
            chosen = torch.tensor([tokens[i] for i in want])
            for i, row in zip(want, top_logprobs(logits[idx], chosen, num)):
                n = sampled_seqs[i].sampling_params.logprobs or 0
                keep = dict(list(row.items())[: n + 1]) if n < num else row
                logprobs[sampled_seqs[i].request_id] = keep
        return ExecutorOutput(sampled, logprobs)

    def prepare_batch(self, plan: SchedulerOutput) -> tuple[
            torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence]]:
        """Flatten the plan's chunks into model inputs and attention metadata."""
        bs, caps = self.block_size, self.attention_caps
        input_ids: list[int] = []
        positions: list[int] = []
        slot_block: list[int] = []
        slot_offset: list[int] = []
        fresh: dict[int, list[int]] = {}
        tile_fresh = TileBatchBuilder()
        tile_ctx = TileBatchBuilder()
        ctx_gather: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        ctx_split: list[tuple[int, int, torch.Tensor, int]] = []
        paged_rows: list[int] = []
        paged_seq: list[int] = []
        paged_pos: list[int] = []
        paged_tables: list[list[int]] = []
        paged_ctx: list[int] = []
        paged_spans: list[tuple[int, int]] = []
        logits_rows: list[int] = []
        spec_rows: list[int] = []
        sampled_seqs: list[Sequence] = []
        out_sampled: list[tuple[list[int], range]] = []  # per chunk with logits rows: (table, their positions)
        out_spec: list[tuple[list[int], range]] = []
        for chunk in plan.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            table = plan.block_tables[seq.request_id]
            row0 = len(input_ids)
            end = start + n
            if chunk.num_spec:
                input_ids.extend(seq.token_ids[start:end - chunk.num_spec])
                input_ids.extend(seq.spec_token_ids[:chunk.num_spec])
            else:
                input_ids.extend(seq.token_ids[start:end])
            pos = range(start, end)
            positions.extend(pos)
            slot_block.extend(table[p // bs] for p in pos)
            slot_offset.extend(p % bs for p in pos)
            path = attention_path(start, n, caps)
            if path is AttentionPath.FRESH_TILES:
                tile_fresh.add(row0, n, 0)
            elif path is AttentionPath.FRESH:
                fresh.setdefault(n, []).append(row0)
            elif path is AttentionPath.CONTEXT_SPLIT:
                prefix = torch.tensor(table[: -(-start // bs)], dtype=torch.long, device=self.device)
                ctx_split.append((row0, n, prefix, start))
            elif path is AttentionPath.CONTEXT_TILES:
                tile_ctx.add(row0, n, start, table[: -(-end // bs)])
            elif path is AttentionPath.CONTEXT_GATHER:
                blocks = torch.tensor(table[: -(-end // bs)], dtype=torch.long, device=self.device)
                # SDPA's mask, once for every layer
                bias = mask_bias(context_mask(end, torch.arange(start, end, device=self.device)), self.dtype)
                ctx_gather.append((row0, n, blocks, end, bias))
            else:
                paged_spans.append((len(paged_rows), n))
                paged_rows.extend(range(row0, row0 + n))
                paged_seq.extend([len(paged_tables)] * n)
                paged_pos.extend(pos)
                paged_tables.append(table[: -(-end // bs)])
                paged_ctx.append(end)
            if chunk.num_spec:
                spec_rows.extend(range(row0 + n - 1 - chunk.num_spec, row0 + n))
                out_spec.append((table[: -(-end // bs)], range(end - 1 - chunk.num_spec, end)))
            elif chunk.samples:
                logits_rows.append(row0 + n - 1)
                sampled_seqs.append(seq)
                out_sampled.append((table[: -(-end // bs)], range(end - 1, end)))
        logits_rows.extend(spec_rows)  # verification rows come after the sampled ones
        dev = self.device
        sampled_meta = None
        if len(logits_rows) < len(input_ids):
            sampled_meta = self._paged_meta(out_sampled + out_spec)
        meta = AttentionMetadata(
            slot_block=torch.tensor(slot_block, dtype=torch.long, device=dev),
            slot_offset=torch.tensor(slot_offset, dtype=torch.long, device=dev),
            fresh_groups=[(starts, length) for length, starts in fresh.items()],
            paged_rows=torch.tensor(paged_rows, dtype=torch.long, device=dev) if paged_rows else None,
            paged_seq_idx=torch.tensor(paged_seq, dtype=torch.int32, device=dev) if paged_rows else None,
            paged_pos=torch.tensor(paged_pos, dtype=torch.int32, device=dev) if paged_rows else None,
            paged_block_tables=pad_tables(paged_tables, dev) if paged_rows else None,
            paged_ctx_lens=paged_ctx,
            paged_q_spans=paged_spans,
            use_kernel=self.use_kernel,
            tile_fresh=tile_fresh.build(dev),
            tile_ctx=tile_ctx.build(dev),
            ctx_gather=ctx_gather,
            ctx_split=ctx_split,
            sampled=sampled_meta,
        )
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta,
                torch.tensor(logits_rows, dtype=torch.long, device=dev), sampled_seqs)

    def _paged_meta(self, seqs: list[tuple[list[int], range]]) -> AttentionMetadata:
        """Metadata for rows that all take the paged path: per sequence its block table and the
        positions of its rows, which are consecutive in the batch; their K/V is already stored."""
        dev = self.device
        empty = torch.empty(0, dtype=torch.long, device=dev)
        seq_idx = [i for i, (_, pos) in enumerate(seqs) for _ in pos]
        spans, row = [], 0
        for _, pos in seqs:
            spans.append((row, len(pos)))
            row += len(pos)
        return AttentionMetadata(
            slot_block=empty, slot_offset=empty, fresh_groups=[],
            paged_rows=torch.arange(row, dtype=torch.long, device=dev) if row else None,
            paged_seq_idx=torch.tensor(seq_idx, dtype=torch.int32, device=dev) if row else None,
            paged_pos=torch.tensor([p for _, pos in seqs for p in pos], dtype=torch.int32, device=dev) if row else None,
            paged_block_tables=pad_tables([t for t, _ in seqs], dev) if row else None,
            paged_ctx_lens=[pos.stop for _, pos in seqs],
            paged_q_spans=spans,
            use_kernel=self.use_kernel,
        )

    def _sample_row(self, seq: Sequence) -> SampleRow:
        params = seq.sampling_params
        banned: tuple[int, ...] = ()
        # A guided request ends when its grammar does: banning EOS there would leave no token.
        if seq.num_output_tokens < params.min_tokens and params.guided is None:
            banned = tuple(set(seq.eos_token_ids) | set(params.stop_token_ids))
        output_ids = seq.output_token_ids if params.has_penalties else None
        prompt_ids = self._distinct_prompt_ids(seq) if params.repetition_penalty != 1.0 else None
        if params.is_greedy:
            return SampleRow(params, None, banned, output_ids, prompt_ids)
        if params.seed is None:
            return SampleRow(params, self._default_generator, banned, output_ids, prompt_ids)
        entry = self._generators.get(seq.request_id)
        if entry is None or entry[0] is not seq:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            entry = self._generators[seq.request_id] = (seq, gen)
        return SampleRow(params, entry[1], banned, output_ids, prompt_ids)

    def _distinct_prompt_ids(self, seq: Sequence) -> torch.Tensor:
        """The prompt's distinct token ids (within the vocabulary); found once per request (a prompt may be 100k
        tokens)."""
        entry = self._prompt_ids.get(seq.request_id)
        if entry is None or entry[0] is not seq:
            ids = torch.tensor(seq.token_ids[:seq.num_prompt_tokens], dtype=torch.long, device=self.device)
            entry = self._prompt_ids[seq.request_id] = (seq, torch.unique(ids[ids < self.arch.vocab_size]))
        return entry[1]

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints (cached); built on first use.

        Call `compile(params.guided)` when a request arrives: a bad spec raises ValueError
        there instead of inside a step, and the step then finds the grammar cached.
        """
        if self._grammar_compiler is None:
            from sessionserve.model.structured import GrammarCompiler
            self._grammar_compiler = GrammarCompiler(self.model_dir)
        return self._grammar_compiler

    def _constraint(self, seq: Sequence) -> Constraint | None:
        """The grammar state of a guided request, created on its first sample and kept across preemption."""
        guided = seq.sampling_params.guided
        if guided is None:
            return None
        entry = self._constraints.get(seq.request_id)
        if entry is None or entry[0] is not seq:
            constraint = self.grammar_compiler.constraint(guided, seq.sampling_params.stop_token_ids)
            entry = self._constraints[seq.request_id] = (seq, constraint)
        constraint = entry[1]
        if constraint.num_seen_tokens != seq.num_output_tokens:
            constraint.sync(seq.output_token_ids)  # tokens that reached the output without `accept`
        return constraint


def _drop_finished(per_request: dict[str, tuple[Sequence, object]]) -> None:
    """Forget the state of finished requests (their ids may be reused by later requests)."""
    for rid in [rid for rid, (s, _) in per_request.items() if s.is_finished]:
        del per_request[rid]
