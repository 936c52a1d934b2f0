"""A stream's engine outputs one token each, for a chat stream whose logprobs go through a shaper.

The engine folds the deltas a consumer has not read yet into one (``merge_pending``: a slow client;
speculative decoding's accepted tokens come together too), so one delta may hold the end of the
thinking and the start of the answer, or a tool call and the text after it. A chat chunk carries
the logprobs of its delta's tokens, and the Responses API gives a message item the logprobs of the
tokens its text came from (``server/text_logprobs.py``, which follows each token's text through
the shaper): a folded delta's tokens could not be told apart, so which tokens a message's logprobs
hold would depend on how fast the client read. Read again one token at a time, each token's logprob
goes with its own text, as in a stream read as fast as the engine wrote it.

Each token's text comes from a detokenizer of the chat stream's own that follows the engine's
(same tokenizer, sampling parameters and prompt). A delta is split only when its tokens' texts
join to the engine's text for it; if they ever do not (a token the engine refused and did not
write), the delta and every one after it go on as they come: text is never taken from anywhere
but the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.tokenizer import Tokenizer
from server.sequence_request import SequenceRequest


class TokenSplitter:
    """One sequence's outputs split into single-token outputs (``split``)."""

    def __init__(self, tokenizer: Tokenizer, seq: SequenceRequest) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.params, seq.prompt_token_ids)
        if seq.resume_token_ids:  # the resumed tokens' text is the client's already
            self.detokenizer.append(list(seq.resume_token_ids))
        self.in_step = True  # its texts are the engine's so far

    def split(self, out: RequestOutput) -> list[RequestOutput]:
        o = out.outputs[0]
        ids = o.token_ids
        if not self.in_step or not ids:
            return [out]
        texts = [self.detokenizer.append([token]) for token in ids[:-1]]
        texts.append(self.detokenizer.append([ids[-1]], stop_terminated=ended_by_token(out)))
        if out.finished:
            texts[-1] += self.detokenizer.flush()
        if "".join(texts) != o.text:
            self.in_step = False
            return [out]
        if len(ids) == 1:
            return [out]
        return [_token_output(out, o, i, text) for i, text in enumerate(texts)]


def ended_by_token(out: RequestOutput) -> bool:
    """Whether ``out``'s last token ends the request as the EOS, a stop token or the end of its
    constraint: the engine leaves its text out (unless ``include_stop_str_in_output``). A stop
    string's token (found in the text) or the length's has its text."""
    o = out.outputs[0]
    return out.finished and o.finish_reason != "length" and not isinstance(o.stop_reason, str)


def _token_output(out: RequestOutput, o: CompletionOutput, i: int, text: str) -> RequestOutput:
    """The ``i``-th token of ``out`` as an output of its own: only the last one ends the request and
    carries what the engine attaches to the last output."""
    if i == len(o.token_ids) - 1:
        last = dataclasses.replace(
            o,
            text=text,
            token_ids=[o.token_ids[i]],
            logprobs=o.logprobs[i:] if o.logprobs is not None else None,
        )
        return dataclasses.replace(out, outputs=[last])
    one = CompletionOutput(
        index=o.index,
        text=text,
        token_ids=[o.token_ids[i]],
        cumulative_logprob=o.cumulative_logprob,
        logprobs=o.logprobs[i : i + 1] if o.logprobs is not None else None,
    )
    return RequestOutput(
        request_id=out.request_id,
        prompt=out.prompt,
        prompt_token_ids=out.prompt_token_ids,
        outputs=[one],
        num_cached_tokens=out.num_cached_tokens,
        metrics=out.metrics,
    )


async def one_token_each(
    tokenizer: Tokenizer,
    seqs: list[SequenceRequest],
    outs: AsyncIterator[tuple[SequenceRequest, RequestOutput]],
) -> AsyncIterator[tuple[SequenceRequest, RequestOutput]]:
    """``outs`` (``Generation.merged``'s) with every delta of several tokens split into one per token.
    Closing this closes ``outs`` (its cleanup aborts the engine request)."""
    splitters = {seq.choice_index: TokenSplitter(tokenizer, seq) for seq in seqs}
    async with contextlib.aclosing(outs):  # type: ignore[type-var]
        async for seq, out in outs:
            for part in splitters[seq.choice_index].split(out):
                yield seq, part
