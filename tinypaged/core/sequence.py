"""Sequence state: the token ids of one generation stream and how far its KV cache has been computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, on the GPU, swapped to CPU, or finished (and why)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    # True for every FINISHED_* status: a plain attribute of each member, set below (it is read for every
    # sequence of every step, and an Enum's own hash, behind a set lookup, is a Python-level call).
    is_finished: bool


for _status in SequenceStatus:
    _status.is_finished = _status.name.startswith("FINISHED_")


class Sequence:
    """One stream of tokens (prompt + generated output) and its progress through the model."""

    __slots__ = (
        "seq_id",
        "token_ids",
        "prompt_len",
        "num_computed_tokens",
        "status",
        "num_pending",
        "spec_token_ids",
    )

    def __init__(self, seq_id: int, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        # Tokens whose K/V are in the cache; the rest (at least the newest token) still need a forward pass.
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        # Tokens sampled on the device but not yet known on the host (async scheduling): they count in
        # num_tokens, so the scheduler runs them, but token_ids holds only tokens the host has seen.
        self.num_pending = 0
        # Speculative decoding: tokens a proposer guessed to follow token_ids, for the next schedule to verify
        # with the last token. Never part of token_ids: only the tokens the target accepts are appended.
        self.spec_token_ids: tuple[int, ...] = ()

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt part of token_ids (a copy)."""
        return self.token_ids[: self.prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated part of token_ids (a copy)."""
        return self.token_ids[self.prompt_len :]

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length, counting tokens still pending on the device."""
        return len(self.token_ids) + self.num_pending

    def append_token(self, token_id: int) -> None:
        """Append one sampled token; its K/V will be computed in the next step."""
        self.token_ids.append(token_id)

    def add_pending(self) -> None:
        """A token was sampled on the device; its value arrives later through resolve_pending()."""
        self.num_pending += 1

    def resolve_pending(self, token_id: int) -> None:
        """The oldest pending token's value has arrived."""
        assert self.num_pending > 0, f"seq {self.seq_id} has no pending token"
        self.num_pending -= 1
        self.token_ids.append(token_id)

    def fork(self, new_seq_id: int) -> Sequence:
        """A copy of this sequence's token state under a new id (its blocks are shared by the manager)."""
        assert not self.num_pending, "a sequence forks only when its tokens are known"
        child = Sequence(new_seq_id, self.token_ids)
        child.prompt_len = self.prompt_len
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, prompt={self.prompt_len}, "
            f"computed={self.num_computed_tokens}, pending={self.num_pending}, {self.status.name})"
        )


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request (n > 1 and beam search fork children into the same group)."""

    request_id: str
    seqs: list[Sequence]
    arrival_time: float
    # False: the prompt must run whole (its tokens are scored), so no prefix-cache hit is taken for it.
    reads_prefix_cache: bool = True
    # The client request this group is one prompt of (an HTTP request with several prompts): the scheduler
    # shares admission between client requests, not groups (see Scheduler). None: a client request of its own.
    client_request_id: str | None = None
    # Set by the scheduler when it last brought the group onto the GPU (admission or swap-in): the latest
    # arrival_time of any group added by then. A group waiting that arrived later is new to it.
    arrivals_seen: float = 0.0
    # The most tokens each sequence may generate (SamplingParams.max_tokens; None: up to max_model_len). Read only
    # by a reservation policy (core/reservation.py), which reserves for the whole output up front.
    max_tokens: int | None = None

    @property
    def client_key(self) -> str:
        """Whose turn this group's admission takes: its client request's id, else its own request id."""
        return self.client_request_id if self.client_request_id is not None else self.request_id

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        """All sequences, or those with the given status."""
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status == status]

    def unfinished_seqs(self) -> list[Sequence]:
        """Sequences that are not finished."""
        return [s for s in self.seqs if not s.status.is_finished]

    def num_unfinished_seqs(self) -> int:
        """How many sequences are not finished."""
        return sum(1 for s in self.seqs if not s.status.is_finished)

    def is_finished(self) -> bool:
        """True once every sequence is finished."""
        return all(s.status.is_finished for s in self.seqs)
