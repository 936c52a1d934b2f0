"""What one step computes: the scheduler's hand-off to the model runner and the engine.

``Scheduler.schedule()`` returns a ``SchedulerOutput``: the requests scheduled with how many tokens
each computes from where (``ScheduledRequest``, drafts included), the requests it preempted, and
the KV block copies (``BlockCopy``) the runner makes before the forward pass. The model runner, the
draft models and the engine read these types without depending on how a step was planned. Plain
data: nothing here decides anything or imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    start: int  # request.num_computed_tokens when scheduled
    # Of those, draft tokens (request.spec_token_ids) after its last known token: verified this step.
    num_spec: int = 0

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens and so draws the next one (and,
        with drafts, one at each draft's position)."""
        return self.start + self.num_new_tokens - self.num_spec == self.request.num_tokens


@dataclass(frozen=True)
class BlockCopy:
    """Copy block ``src``'s KV (every layer, every part) into block ``dst`` before the step's
    forward pass: a cached partial block reused by a request admitted this step."""

    src: int
    dst: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)  # run first; sources pinned until then

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
