"""Train small models on Python source, so a target and its draft have real weights.

``make_model`` writes random weights: enough for exactness tests, but a random
draft's proposals are accepted only by chance and a random model's routing
costs say nothing about real ones.  ``train_model`` trains one shape with
Hugging Face transformers (AdamW, linear warmup then cosine decay, bf16
autocast on CPUs with native bf16 dot products, fp32 master weights) on text
every machine has: the standard library's own ``*.py`` sources, tokenized
with the shared embedded tokenizer.  It writes the same HF folder as
``make_model`` (same tokenizer files, chat template and generation_config,
weights under HF names in fp32) plus ``training.json`` with the settings,
losses and wall time.

``train_pair`` trains a target and a smaller draft.  By default the draft is
trained separately: same corpus, same seed, so the same batches in the same
order as the target.  ``distill.distill_model`` (``--distill``) instead trains it to
match the target's next-token distributions (KL), half of each batch on
corpus text and half on the target's own greedy continuations of corpus
prompts, the text a draft has to predict; ``training.json`` then records
its greedy agreement with the target on held-out prompts.  Both share the
tokenizer, so the draft's proposals can be verified by the target token for
token.

Files are taken in a fixed order (``corpus_files``: sorted, evenly strided);
every ``eval_file_stride``-th file is held out for the eval loss.  The budget
is in optimizer steps, so a run is reproducible for a seed on one machine;
``max_train_s`` is an extra wall-clock cap: the schedule then follows
whichever of steps and time is further along, so a capped run still anneals,
but it (recorded as ``"stopped_by": "time"`` when the cap ended it) is not
reproducible.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from sessionserve.modelgen.make_model import shape_config, special_token_ids, weight_shapes, write_model_folder
from sessionserve.modelgen.tokenizer_train import corpus_files, default_cache_dir, ensure_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Context the config advertises.  Training sees only seq_len tokens at a time;
# later positions still run (RoPE), with quality degrading past seq_len.
MAX_POSITIONS = 4096


@dataclass(frozen=True)
class TrainShape:
    """A decoder's size; head_dim is fixed so attention kernels see the usual 64."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int = 64

    def config_shape(self) -> dict[str, int]:
        """The shape fields of config.json (see ``make_model.shape_config``)."""
        return {"hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "intermediate_size": self.intermediate_size, "max_position_embeddings": MAX_POSITIONS,
                "head_dim": self.head_dim}


SHAPES: dict[str, TrainShape] = {
    # ~22M params (12.6M of them the untied embedding and lm_head over the 16k vocab).
    "target": TrainShape(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                         intermediate_size=1024),
    # ~10M params; about a third of the target's FLOPs per token.
    "draft": TrainShape(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=768),
    # ~39M params: a target with a wider gap to its draft (8 x 512).
    "large": TrainShape(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                        intermediate_size=1408),
    # ~129M params: the shape of the embedded llama-small (12 x 768, GQA 12/4), trained: a large model
    # 13x the 2 x 256 draft, whose steps cost what a large model's do beside it (see README).
    "xl": TrainShape(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                     intermediate_size=3072),
    # ~4.4M params, most of them the embedding and lm_head: a draft whose step costs little beside its
    # target's (2 x 128); distill it (`--distill-from`) so that it agrees with the target.
    "mini": TrainShape(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=384),
    # For tests: trains in well under a second per few steps.
    "tiny": TrainShape(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=128, head_dim=32),
}

# Default optimizer steps: a few CPU minutes per model on 2 cores (see README).
DEFAULT_NUM_STEPS = 300


@dataclass(frozen=True)
class TrainConfig:
    """How long and on what to train; one value for target and draft."""

    num_steps: int = DEFAULT_NUM_STEPS  # optimizer steps: the reproducible budget
    batch_size: int = 8  # sequences per step (2048 tokens: many small steps beat few big ones this short)
    seq_len: int = 256  # tokens per sequence (the model predicts seq_len targets)
    lr: float = 1e-3  # peak; beat 3e-3 and 6e-3 in an 80-step comparison on the draft
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of lr
    warmup_ratio: float = 0.05  # fraction of num_steps spent warming up linearly
    weight_decay: float = 0.1  # on matrices only, not norms
    grad_clip: float = 1.0  # max global grad norm
    max_corpus_bytes: int = 12_000_000  # source bytes read; more than a default run consumes
    eval_file_stride: int = 20  # every 20th file is held out (5%)
    num_eval_windows: int = 32  # seq_len windows spread over the held-out tokens
    seed: int = 0  # model init and batch order
    max_train_s: float | None = None  # extra wall-clock cap on the step loop; None: steps only
    # bf16 autocast for matmuls; None: on where the CPU has native bf16 dot products.
    use_bf16: bool | None = None
    log_every: int = 25  # steps between progress lines on stderr; 0: silent

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_size", "seq_len", "max_corpus_bytes", "eval_file_stride",
                     "num_eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_file_stride < 2:
            raise ValueError("eval_file_stride must be >= 2 (some files must remain for training)")
        if self.max_train_s is not None and self.max_train_s <= 0:
            raise ValueError(f"max_train_s must be > 0, got {self.max_train_s}")
        if not (0.0 < self.lr and 0.0 <= self.min_lr_ratio <= 1.0 and 0.0 <= self.warmup_ratio < 1.0):
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1, 0 <= warmup_ratio < 1")


class Corpus(NamedTuple):
    """Token streams of the train and held-out files, documents separated by <|endoftext|>."""

    train_ids: torch.Tensor  # (N_train,) int64
    eval_ids: torch.Tensor  # (N_eval,) int64
    num_train_files: int
    num_eval_files: int


class TrainResult(NamedTuple):
    path: Path
    record: dict[str, Any]  # the contents of training.json


def load_corpus(tok_path: Path, max_bytes: int, eval_file_stride: int) -> Corpus:
    """Tokenize the stdlib sample; files i % eval_file_stride == 0 are held out."""
    files = corpus_files(max_bytes)
    tok = Tokenizer.from_file(str(tok_path))
    _, eod = special_token_ids(tok_path)

    def stream(paths: list[Path]) -> torch.Tensor:
        # errors="replace": a few stdlib files are latin-1 (as in tokenizer training).
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in paths]
        ids: list[int] = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eod)
        return torch.tensor(ids, dtype=torch.long)

    eval_files = files[::eval_file_stride]
    train_files = [f for i, f in enumerate(files) if i % eval_file_stride]
    return Corpus(stream(train_files), stream(eval_files), len(train_files), len(eval_files))


def sample_batch(ids: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """batch_size random windows of seq_len + 1 tokens: (B, T+1)."""
    if len(ids) < seq_len + 2:
        raise ValueError(f"corpus has {len(ids)} tokens, too few for seq_len {seq_len}")
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=gen)
    return torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])


def eval_windows(ids: torch.Tensor, seq_len: int, num_windows: int) -> torch.Tensor:
    """Up to num_windows windows of seq_len + 1 tokens, evenly spread over ids: (W, T+1)."""
    if len(ids) < seq_len + 1:
        raise ValueError(f"held-out corpus has {len(ids)} tokens, too few for seq_len {seq_len}")
    num = min(num_windows, len(ids) // (seq_len + 1))
    starts = torch.linspace(0, len(ids) - seq_len - 1, num).long().tolist()
    return torch.stack([ids[s:s + seq_len + 1] for s in starts])


def lr_at(progress: float, cfg: TrainConfig) -> float:
    """Learning rate at progress in [0, 1] of the budget: linear warmup over warmup_ratio,
    then cosine decay to lr * min_lr_ratio at 1."""
    if progress < cfg.warmup_ratio:
        return cfg.lr * max(progress / cfg.warmup_ratio, 1.0 / cfg.num_steps)
    decay = (progress - cfg.warmup_ratio) / (1.0 - cfg.warmup_ratio)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, decay)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def budget_progress(step: int, elapsed_s: float, cfg: TrainConfig) -> float:
    """Fraction of the budget used before `step`: steps, or time under max_train_s if further along.

    NOTE: taking the larger lets a run cut short by the time cap still anneal.
    """
    progress = step / max(1, cfg.num_steps - 1)
    if cfg.max_train_s is not None:
        progress = max(progress, elapsed_s / cfg.max_train_s)
    return min(1.0, progress)


def cpu_bf16_is_fast() -> bool:
    """Whether oneDNN runs bf16 matmuls natively here (AVX-512 BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def build_hf_model(cfg: dict[str, Any], seed: int) -> PreTrainedModel:
    """The transformers model for config.json contents, initialised from seed (fp32)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:  # a test extra, not a runtime dependency
        raise RuntimeError("make-model --train needs transformers: pip install 'transformers>=4.45'") from e
    hf_cfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(hf_cfg)  # fp32: torch's default dtype


def batch_loss(model: PreTrainedModel, batch: torch.Tensor, use_bf16: bool) -> torch.Tensor:
    """Mean next-token cross entropy (nats) over a (B, T+1) batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T), (B, T)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
        logits = model(input_ids=inputs, use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def eval_loss(model: PreTrainedModel, windows: torch.Tensor, chunk: int = 8) -> float:
    """Mean loss over the fixed eval windows, in fp32: the precision the folder is saved and served in."""
    model.eval()
    losses = [batch_loss(model, windows[i:i + chunk], use_bf16=False) * len(windows[i:i + chunk])
              for i in range(0, len(windows), chunk)]
    model.train()
    return float(torch.stack(losses).sum() / len(windows))


def _optimizer(model: PreTrainedModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]  # norm gains
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _hf_weights(model: PreTrainedModel, arch: str, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict under exactly the names and shapes ``make_model`` writes (fp32)."""
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(arch, cfg).items():
        t = state[name].detach().to(torch.float32).contiguous()
        if tuple(t.shape) != shape:
            raise RuntimeError(f"{name}: trained shape {tuple(t.shape)} != expected {shape}")
        tensors[name] = t
    return tensors


@dataclass
class TrainingRun:
    """One model being trained (or distilled): its config, corpus, weights and progress.

    `start` builds the model (initialised from the seed); `fit` runs the
    optimizer on whatever loss it is given; `finish` writes the HF folder with
    ``training.json`` (the common record plus the caller's extra fields).
    """

    role: str
    arch: str
    shape: TrainShape
    train: TrainConfig
    tok_path: Path
    cfg: dict[str, Any]
    corpus: Corpus
    use_bf16: bool
    windows: torch.Tensor  # held-out eval windows
    model: PreTrainedModel
    initial_eval: float
    losses: list[float] = field(default_factory=list)
    stopped_by: str = "steps"
    train_s: float = 0.0

    @classmethod
    def start(cls, shape: TrainShape, train: TrainConfig, *, arch: str, role: str, cache_dir: Path | None,
              corpus: Corpus | None) -> TrainingRun:
        tok_path = ensure_tokenizer(cache_dir)
        eos, pad = special_token_ids(tok_path)
        cfg = shape_config(arch, shape.config_shape(), eos, pad)
        if corpus is None:
            corpus = load_corpus(tok_path, train.max_corpus_bytes, train.eval_file_stride)
        use_bf16 = cpu_bf16_is_fast() if train.use_bf16 is None else train.use_bf16
        windows = eval_windows(corpus.eval_ids, train.seq_len, train.num_eval_windows)
        model = build_hf_model(cfg, train.seed)
        return cls(role, arch, shape, train, tok_path, cfg, corpus, use_bf16, windows, model,
                   eval_loss(model, windows))

    def fit(self, next_loss: Callable[[], torch.Tensor]) -> None:
        """The optimizer loop: `next_loss()` draws a batch and returns its loss."""
        model, train = self.model, self.train
        model.train()
        opt = _optimizer(model, train)
        start = time.perf_counter()
        for step in range(train.num_steps):
            lr = lr_at(budget_progress(step, time.perf_counter() - start, train), train)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = next_loss()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
            opt.step()
            self.losses.append(loss.item())
            if train.log_every and ((step + 1) % train.log_every == 0 or step + 1 == train.num_steps):
                elapsed = time.perf_counter() - start
                tok_s = (step + 1) * train.batch_size * train.seq_len / elapsed
                print(f"[{self.role}] step {step + 1}/{train.num_steps} loss {loss.item():.3f} "
                      f"lr {lr:.2e} {tok_s:.0f} tok/s {elapsed:.0f}s", file=sys.stderr, flush=True)
            # Checked after a step, so even a tiny cap trains at least one.
            if train.max_train_s is not None and step + 1 < train.num_steps \
                    and time.perf_counter() - start >= train.max_train_s:
                self.stopped_by = "time"
                break
        self.train_s = time.perf_counter() - start

    def finish(self, out_dir: str | Path, extra: dict[str, Any]) -> TrainResult:
        """Write the HF folder; ``training.json`` holds the run's settings, losses, wall time and `extra`."""
        model, train, corpus = self.model, self.train, self.corpus
        tail = self.losses[-max(1, len(self.losses) // 10):]  # the last 10% of steps: a smoothed final loss
        record = {
            "role": self.role,
            "arch": self.arch,
            "shape": asdict(self.shape),
            "num_params": sum(p.numel() for p in model.parameters()),
            "train_config": asdict(train),
            "use_bf16": self.use_bf16,
            "num_steps_done": len(self.losses),
            "stopped_by": self.stopped_by,
            "num_train_tokens_seen": len(self.losses) * train.batch_size * train.seq_len,
            "corpus": {"num_train_files": corpus.num_train_files, "num_eval_files": corpus.num_eval_files,
                       "num_train_tokens": len(corpus.train_ids), "num_eval_tokens": len(corpus.eval_ids),
                       "num_eval_windows": len(self.windows)},
            "initial_eval_loss": self.initial_eval,
            "final_train_loss": sum(tail) / len(tail),
            "final_eval_loss": eval_loss(model, self.windows),
            "train_s": round(self.train_s, 2),
            "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__,
            **extra,
        }
        path = write_model_folder(out_dir, self.cfg, lambda: _hf_weights(model, self.arch, self.cfg),
                                  self.tok_path, {"training.json": record})
        return TrainResult(path, record)


def train_model(
    out_dir: str | Path,
    shape: TrainShape,
    train: TrainConfig = TrainConfig(),
    *,
    arch: str = "llama",
    role: str = "model",
    cache_dir: Path | None = None,
    corpus: Corpus | None = None,
) -> TrainResult:
    """Train one model and write its HF folder (replacing out_dir).

    corpus: pass one from ``load_corpus`` to share tokenization between models.
    """
    run = TrainingRun.start(shape, train, arch=arch, role=role, cache_dir=cache_dir, corpus=corpus)
    gen = torch.Generator().manual_seed(train.seed)
    ids = run.corpus.train_ids
    run.fit(lambda: batch_loss(run.model, sample_batch(ids, train.batch_size, train.seq_len, gen), run.use_bf16))
    return run.finish(out_dir, {"distilled": False})


def train_pair(
    out_dir: str | Path | None = None,
    train: TrainConfig = TrainConfig(),
    *,
    arch: str = "llama",
    target_shape: TrainShape = SHAPES["target"],
    draft_shape: TrainShape = SHAPES["draft"],
    cache_dir: Path | None = None,
    distill: bool = False,
) -> tuple[TrainResult, TrainResult]:
    """Train target then draft (on the same batches, or distilled from the target); write OUT/target and
    OUT/draft.

    out_dir None: ``<cache_dir>/trained-target`` and ``<cache_dir>/trained-draft``.
    """
    target_dir, draft_dir = pair_dirs(out_dir, cache_dir)
    corpus = load_corpus(ensure_tokenizer(cache_dir), train.max_corpus_bytes, train.eval_file_stride)
    target = train_model(target_dir, target_shape, train, arch=arch, role="target", cache_dir=cache_dir,
                         corpus=corpus)
    if distill:
        from sessionserve.modelgen.distill import distill_model  # it builds on this module

        draft = distill_model(draft_dir, target.path, draft_shape, train, arch=arch, cache_dir=cache_dir,
                              corpus=corpus)
    else:
        draft = train_model(draft_dir, draft_shape, train, arch=arch, role="draft", cache_dir=cache_dir,
                            corpus=corpus)
    return target, draft


def default_trained_dir(role: str, cache_dir: Path | None = None) -> Path:
    """``<cache_dir>/trained-<role>``, beside the random default models."""
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / f"trained-{role}"


def pair_dirs(out_dir: str | Path | None, cache_dir: Path | None = None) -> tuple[Path, Path]:
    """(target, draft) folders: OUT/target and OUT/draft, or the cache defaults."""
    if out_dir is None:
        return default_trained_dir("target", cache_dir), default_trained_dir("draft", cache_dir)
    return Path(out_dir) / "target", Path(out_dir) / "draft"


def summary(result: TrainResult) -> str:
    """One line for the CLI: where, how big, how long, how good."""
    r = result.record
    return (f"{result.path}  {r['role']}: {r['num_params'] / 1e6:.1f}M params, {r['num_steps_done']} steps "
            f"in {r['train_s']:.0f}s, train loss {r['final_train_loss']:.3f}, eval loss {r['final_eval_loss']:.3f} "
            f"(from {r['initial_eval_loss']:.3f})")

