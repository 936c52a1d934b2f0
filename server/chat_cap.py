"""Where a capped answer ends: the token that completes its last allowed tool call.

The Responses API's ``max_tool_calls`` stops an ``auto`` answer once it has every call it may have
(``ChoiceTools.capped``, ``chat_stream.stream_chunks``). The engine hands its tokens over in deltas that
hold as many tokens as were generated since the server last read (``merge_pending``), so the delta
in which the last call completes may carry a few tokens past it: those are not part of the answer.
The answer is cut at the token that completes the call, as a stop string cuts at the token that
completes it, so what it shows and what its usage counts do not depend on how the tokens were
batched. Only the capped delta is read again, token by token, by a shaper that takes the earlier
text in again: nothing is copied or kept for the deltas before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from server.chat_shape import ChoiceShaper, Shaped
from server.sequence_request import SequenceRequest


def cut_at_cap(
    tokenizer: Tokenizer,
    seq: SequenceRequest,
    new_shaper: Callable[[], ChoiceShaper],
    earlier_ids: Sequence[int],
    token_ids: Sequence[int],
) -> tuple[int, Shaped, ChoiceShaper]:
    """(how many of the delta's ``token_ids`` the answer keeps, what they show, the shaper that read
    them): ``earlier_ids`` are the choice's tokens before the delta (a resumed stream's included),
    ``new_shaper`` makes a shaper in the state the choice's began in."""
    detokenizer = IncrementalDetokenizer(tokenizer, seq.params, seq.prompt_token_ids)
    shaper = new_shaper()
    shaper.skip(detokenizer.append(list(earlier_ids)))
    out = Shaped()
    if shaper.capped:  # a resumed stream whose resumed text already had every call
        return 0, out, shaper
    for kept, token_id in enumerate(token_ids, 1):
        out = out.then(shaper.feed(detokenizer.append([token_id])))
        if shaper.capped:
            return kept, out, shaper
    return len(token_ids), out, shaper
