"""vLLM's ``repetition_detection``: end a generation whose output has fallen into a loop.

A request that asks stops ("stop", stop reason ``"repetition_detected"``) once the tail of its output is
one N-gram (``min_pattern_size`` .. ``max_pattern_size`` tokens) written ``min_count`` times in a row.
Torch-free (the server imports it). Only requests that asked pay for the check: the postprocessor looks
at ``SamplingParams.repetition_detection`` once per token and this scan runs only when it is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

STOP_REASON = "repetition_detected"
# Caps on one request's scan: each sampled token compares up to about
# (max - min + 1) * min_count tokens in its worst case.
MAX_PATTERN_SIZE = 1024
MAX_MIN_COUNT = 1024
MAX_SCAN_WORK = 16384


@dataclass(frozen=True)
class RepetitionDetectionParams:
    """``max_pattern_size`` 0 turns the check off; ``min_pattern_size`` 0 means 1; ``min_count`` (at
    least 2 when on) is how many back-to-back copies of the N-gram end the output."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0

    @property
    def smallest(self) -> int:
        return max(self.min_pattern_size, 1)

    def validate(self) -> None:
        """ValueError naming the field at fault (the server turns it into a 400)."""
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"repetition_detection.{name} must be a non-negative integer, got {value!r}")
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError(
                f"repetition_detection.min_pattern_size ({self.min_pattern_size}) must not exceed "
                f"max_pattern_size ({self.max_pattern_size}); set both to 0 to turn detection off"
            )
        if not self.enabled:
            return
        if self.min_count < 2:
            raise ValueError(
                f"repetition_detection.min_count must be at least 2, got {self.min_count}; "
                "set max_pattern_size to 0 to turn detection off"
            )
        if self.max_pattern_size > MAX_PATTERN_SIZE:
            raise ValueError(
                f"repetition_detection.max_pattern_size must be at most {MAX_PATTERN_SIZE}, "
                f"got {self.max_pattern_size}"
            )
        if self.min_count > MAX_MIN_COUNT:
            raise ValueError(
                f"repetition_detection.min_count must be at most {MAX_MIN_COUNT}, got {self.min_count}"
            )
        work = (self.max_pattern_size - self.smallest + 1) * self.min_count
        if work > MAX_SCAN_WORK:
            raise ValueError(
                "repetition_detection: (max_pattern_size - min_pattern_size + 1) * min_count must be at "
                f"most {MAX_SCAN_WORK} (the scan each token costs), got {work}"
            )

    def repeats(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` ends with an N-gram of an allowed size repeated ``min_count`` times."""
        count = self.min_count
        for size in range(self.smallest, self.max_pattern_size + 1):
            span = size * count
            if span > len(token_ids):
                return False  # longer patterns need even more tokens
            # The tail repeats with period ``size`` over ``span`` tokens: each token equals the one
            # ``size`` before it. Scanned from the end, where a loop that just broke differs first.
            for back in range(1, span - size + 1):
                if token_ids[-back] != token_ids[-back - size]:
                    break
            else:
                return True
        return False


def repetition_params(value: RepetitionDetectionParams | dict | None) -> RepetitionDetectionParams | None:
    """The offline API takes the dataclass or its dict (as vLLM's ``SamplingParams`` does)."""
    if isinstance(value, dict):
        value = RepetitionDetectionParams(**value)
    return value
