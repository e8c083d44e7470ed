"""A request's state as the engine sees it: tokens, progress, status; and the two records it carries.

`Program` is the service a program (an agent session's turns, or a lone request) has received, shared by its
requests; `ParkHint` is what the session will wait on after this turn. Every layer reads these: the
scheduler (`core`), the executors (`model`, `sim`), the server that builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import Enum

from sessionserve.types.sampling_params import SamplingParams


@dataclass(eq=False, slots=True)
class Program:
    """Service received by one program (a session's turns share one); ordering uses it in core/priority.py."""

    service_tokens: int = 0
    start_s: float | None = None  # when its first request arrived: its place in line under program order


@dataclass(frozen=True, slots=True)
class SessionBlocks:
    """The KV manager's key for a session's own device blocks between turns (a running turn's blocks are
    under its request id). `closed`: blocks of a closed session that a restore still writes, freed when
    the restore ends. A type of its own, so no request id can name a session's blocks."""

    session_id: str
    closed: bool = False


BlockOwner = str | SessionBlocks  # the key of a block table in the KV manager: a request id, or a session


@dataclass(frozen=True, slots=True)
class ParkHint:
    """What a session turn will wait on once it ends, given with the turn so the residency policy's first
    decision on the parked session already has it: the client's expected tool time, and how to read the
    names of the tools the reply calls from its output token ids (None: it calls none)."""

    expected_wait_s: float | None = None
    tool_names: Callable[[Seq[int]], tuple[str, ...]] | None = None


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


@dataclass(eq=False, slots=True)
class Sequence:
    """One generation request. Identity object: kept in lists and sets by identity.

    Invariants: 0 <= num_computed_tokens <= len(token_ids); the first
    num_prompt_tokens of token_ids are the prompt; a RUNNING sequence holds
    blocks for at least num_computed_tokens tokens.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    arrival_s: float
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    salt: bytes = b""
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission.
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    # When the scheduler last admitted it (its clock); a running sequence keeps the class it had then.
    admitted_s: float | None = None
    # Time this turn waited for its session's KV to come back from a lower tier.
    restore_wait_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None
    stop_reason: int | str | None = None
    # Why the request failed inside a step (its inputs made the executor raise); None: it did not.
    error: str | None = None
    # Key that takes over the blocks when the sequence finishes (a session keeping
    # its KV between turns); None frees them.
    kv_successor: SessionBlocks | None = None
    # Waiting for KV to come back from a lower tier: not schedulable yet.
    is_blocked: bool = False
    # Waiting at the door (core/admission.py): not started, not in the scheduler yet.
    is_held: bool = False
    session_id: str | None = None
    # What the session waits on after this turn (ParkHint above), read when the turn ends.
    park_hint: ParkHint | None = None
    # Priority class rank (0 interactive, 1 batch) and the program (session) whose service it adds to.
    priority: int = 0
    program: Program = field(default_factory=Program)
    # The program's service when this request arrived: its place in line, fixed while it runs
    # (a request is not demoted by its own progress, which would interleave long prefills).
    service_at_arrival: int = 0
    # Per generated token: {token_id: logprob} for the top-n, plus the chosen token.
    logprobs: list[dict[int, float]] | None = field(default=None)
    # Speculative decoding: tokens proposed for the next step (not part of token_ids until the
    # target accepts them), the proposer's distributions for them (None: deterministic proposals),
    # the running per-token acceptance estimate and counters.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: object | None = None
    spec_acceptance: float | None = None
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def check_stop(self, token_id: int) -> SequenceStatus | None:
        """The finished status that appending `token_id` leads to, or None to go on."""
        params = self.sampling_params
        num_out = self.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED
        if num_out >= params.max_tokens or len(self.token_ids) >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None
