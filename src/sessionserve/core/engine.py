"""The engine loop: schedule -> execute -> apply. Token level; text lives outside core.

The engine does not know which clock it runs on: `clock` is any zero-argument
function returning seconds (wall time in serving, virtual time in simulation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.config import SchedulerConfig
from sessionserve.core.executor import Executor
from sessionserve.core.sampling_params import SamplingParams
from sessionserve.core.scheduler import Scheduler, SchedulerOutput
from sessionserve.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class StepOutput:
    """What one step did to one sequence."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


class EngineCore:
    """Holds the scheduler, the KV manager and an executor; runs one step at a time."""

    def __init__(self, scheduler_config: SchedulerConfig, kv: KVCacheManager, executor: Executor,
                 clock: Callable[[], float], eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.kv = kv
        self.scheduler = Scheduler(scheduler_config, kv)
        self.executor = executor
        self.clock = clock
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    salt: bytes = b"") -> Sequence:
        """Queue a request. Raises ValueError for a duplicate id, an empty or too-long prompt."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model's context is "
                             f"{self.max_model_len} tokens, including the output")
        seq = Sequence(request_id=request_id, token_ids=list(prompt_token_ids),
                       num_prompt_tokens=len(prompt_token_ids), sampling_params=params,
                       arrival_s=self.clock(), eos_token_ids=self.eos_token_ids,
                       max_model_len=self.max_model_len, salt=salt)
        self.scheduler.add(seq)
        self.requests[request_id] = seq
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks. False if it is unknown or already finished."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        seq.finished_s = self.clock()
        return True

    def finish(self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_STOPPED) -> None:
        """End a request early (e.g. a stop string matched in its text)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, status)
            seq.finished_s = self.clock()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[StepOutput]:
        """Run one step. Returns the sequences that got a token or finished."""
        plan: SchedulerOutput = self.scheduler.schedule()
        if plan.is_empty:
            return []
        result = self.executor.execute(plan)
        finished = self.scheduler.update(plan, result.sampled)
        now = self.clock()
        self.num_steps += 1
        outputs: list[StepOutput] = []
        for chunk in plan.chunks:
            seq = chunk.seq
            token = result.sampled.get(seq.request_id)
            if token is None or seq.status is SequenceStatus.FINISHED_ABORTED:
                continue
            if seq.first_token_s is None:
                seq.first_token_s = now
            if seq.sampling_params.logprobs is not None:
                if seq.logprobs is None:
                    seq.logprobs = []
                seq.logprobs.append(result.logprobs.get(seq.request_id, {}))
            outputs.append(StepOutput(seq, [token], seq.is_finished))
        for seq in finished:
            seq.finished_s = now
            self.requests.pop(seq.request_id, None)
        return outputs
