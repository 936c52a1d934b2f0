"""Stop conditions: stop strings (split across tokens), EOS, stop_token_ids, max_tokens, min_tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.repetition import RepetitionDetectionParams

PROMPT = "def main(args):\n    return"


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), num_kv_blocks=128)


@pytest.fixture(scope="module")
def free_run(llm) -> tuple[list[int], str]:
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    return out.token_ids, out.text


def test_max_tokens_finishes_with_length(llm, free_run) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == free_run[0][:5]
    assert out.finish_reason == "length" and out.stop_reason is None


def test_stop_string_split_across_tokens(llm, free_run) -> None:
    tokens, text = free_run
    tok = llm.tokenizer
    # A boundary between two tokens with at least 2 characters of text on each side.
    for k in range(2, len(tokens) - 2):
        b = len(tok.decode(tokens[:k]))
        stop = text[b - 2 : b + 2]
        if len(stop) == 4 and text.find(stop) == b - 2 and len(tok.decode(tokens[k : k + 1])) >= 2:
            break
    else:
        pytest.fail("no usable token boundary in the greedy text")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: b - 2]
    assert out.token_ids == tokens[: k + 1]
    kept = llm.generate(PROMPT, SamplingParams(**{**params.__dict__, "include_stop_str_in_output": True}))[0]
    assert kept.outputs[0].text == text[: b + 2]


def test_stop_token_ids(llm, free_run) -> None:
    tokens, _ = free_run
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]))[
        0
    ].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


@pytest.fixture(scope="module")
def eos_model(tiny_llama, free_run, tmp_path_factory) -> tuple[Path, int]:
    """tiny_llama whose config names the greedy run's third token as EOS."""
    tokens, _ = free_run
    eos = tokens[2]
    assert eos not in tokens[:2]
    path = tmp_path_factory.mktemp("eos_model")
    for f in tiny_llama.iterdir():
        shutil.copy(f, path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(cfg))
    return path, eos


def test_eos_stops_unless_ignored(eos_model, free_run) -> None:
    path, eos = eos_model
    tokens, _ = free_run
    llm = LLM(str(path), num_kv_blocks=64)
    assert eos in llm.engine.eos_token_ids
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
    assert out.token_ids == tokens[:3]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == llm.tokenizer.decode(tokens[:2])  # the EOS token's text is left out
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert ignored.outputs[0].token_ids == tokens
    # min_tokens masks EOS until 5 tokens exist.
    held = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, min_tokens=5))[0].outputs[0]
    assert len(held.token_ids) >= 5 and eos not in held.token_ids[:4]
    assert held.token_ids[:2] == tokens[:2]


def test_prompt_logprobs(llm) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    out = llm.generate(PROMPT, params)[0]
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for tok, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True):
        assert tok in entry and entry[tok].logprob <= 0.0
        assert len(entry) <= 3
    # Chunked prefill gives the same prompt logprobs.
    chunked = LLM(str(llm.engine.model_dir), num_kv_blocks=64, max_num_batched_tokens=3).generate(
        PROMPT, params
    )[0]
    for a, b in zip(out.prompt_logprobs[1:], chunked.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits", "raw_logprobs", "processed_logprobs"])
def test_prompt_logprobs_follow_the_logprobs_mode(llm, tiny_llama, mode: str) -> None:
    """A ``*_logits`` logprobs mode gives a prompt position's raw logits, as it does for the sampled
    tokens (vLLM's too): transformers' logits for the same weights; ``*_logprobs`` their
    log-softmax. Nothing processes a prompt position, so processed reads as raw. Per request here;
    the engine's ``logprobs_mode`` sets the default."""
    from tests.engine.conftest import _hf_model

    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = _hf_model(str(tiny_llama))(torch.tensor([ids])).logits[0].float()
    want = logits if mode.endswith("_logits") else torch.log_softmax(logits, dim=-1)
    params = SamplingParams(temperature=0.8, max_tokens=1, prompt_logprobs=2, logprobs_mode=mode)
    out = llm.generate(PROMPT, params)[0]
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row = want[pos - 1]
        for tid, value in entry.items():
            assert value.logprob == pytest.approx(row[tid].item(), abs=1e-4), (pos, tid)
        top = sorted(entry.values(), key=lambda v: v.rank)[:2]
        assert [v.rank for v in top] == [1, 2]
        assert top[0].logprob == pytest.approx(row.max().item(), abs=1e-4)


def test_the_engine_logprobs_mode_applies_to_prompt_logprobs(tiny_llama) -> None:
    engine = LLM(str(tiny_llama), num_kv_blocks=64, logprobs_mode="raw_logits")
    try:
        ids = engine.tokenizer.encode(PROMPT)
        out = engine.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        by_request = engine.generate(
            PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0, logprobs_mode="raw_logprobs")
        )[0]
    finally:
        engine.close()
    from tests.engine.conftest import _hf_model

    with torch.no_grad():
        logits = _hf_model(str(tiny_llama))(torch.tensor([ids])).logits[0].float()
    for pos in range(1, len(ids)):
        assert out.prompt_logprobs[pos][ids[pos]].logprob == pytest.approx(
            logits[pos - 1, ids[pos]].item(), abs=1e-4
        )
        assert by_request.prompt_logprobs[pos][ids[pos]].logprob == pytest.approx(
            torch.log_softmax(logits[pos - 1], dim=-1)[ids[pos]].item(), abs=1e-4
        )


def test_bad_input_is_a_value_error(llm) -> None:
    limit = llm.engine.max_model_len
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(
        ValueError,
        match=rf"prompt \(3 tokens\) \+ max_tokens \({limit}\) = {limit + 3} exceeds max_model_len={limit}",
    ):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=limit))
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate([[5, 10**6]], SamplingParams())
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate([[-1]], SamplingParams())
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_none_fills_what_the_cache_holds(tiny_llama) -> None:
    small = LLM(str(tiny_llama), num_kv_blocks=4)  # 64 tokens of KV in all
    out = small.generate([[5] * 10], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 54 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="needs 5 KV blocks but the cache has only 4"):
        small.generate([[5] * 10], SamplingParams(max_tokens=60))


def test_repetition_scan_finds_the_tail_loop_only() -> None:
    """``RepetitionDetectionParams.repeats``: exact answers on hand-made tails."""
    rule = RepetitionDetectionParams(max_pattern_size=3, min_pattern_size=2, min_count=3)
    assert rule.repeats([9, 1, 2, 3, 1, 2, 3, 1, 2, 3])
    assert not rule.repeats([1, 2, 3, 1, 2, 3])  # two copies, three asked
    assert not rule.repeats([1, 2, 3, 1, 2, 3, 1, 2, 4])  # the loop broke at the last token
    assert not rule.repeats([5, 5, 5, 5])  # a 1-token loop is below min_pattern_size...
    assert RepetitionDetectionParams(3, 0, 3).repeats([5, 5, 5])  # ...which 0 makes 1
    assert rule.repeats([7, 6, 5, 6, 5, 6, 5, 6])  # period 2 (6, 5) after a prefix
    assert not RepetitionDetectionParams().repeats([5] * 10)  # max_pattern_size 0: off
    assert not rule.repeats([])


@pytest.mark.parametrize(
    ("rule", "words"),
    [
        (RepetitionDetectionParams(2, 3, 2), "min_pattern_size (3) must not exceed max_pattern_size (2)"),
        (RepetitionDetectionParams(4, 0, 1), "min_count must be at least 2"),
        (RepetitionDetectionParams(2048, 0, 2), "max_pattern_size must be at most 1024"),
        (RepetitionDetectionParams(1024, 1, 100), "min_count must be at most"),
        ({"max_pattern_size": -1}, "non-negative integer"),
    ],
)
def test_repetition_detection_bad_values(rule, words) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(repetition_detection=rule).validate()


def test_repetition_detection_offline(llm) -> None:
    """The offline API (a dict is taken as vLLM's dataclass): the greedy run stops where its tail first
    holds a loop of the asked size ``min_count`` times, not before ``min_tokens``."""
    full = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))[0].outputs[0]
    ids = list(full.token_ids)

    def first_end(start: int) -> int | None:
        for end in range(start, len(ids) + 1):
            if any(
                len(ids[:end]) >= 3 * n
                and ids[end - n : end] == ids[end - 2 * n : end - n] == ids[end - 3 * n : end - 2 * n]
                for n in range(1, 5)
            ):
                return end
        return None

    rule = {"max_pattern_size": 4, "min_count": 3}
    end = first_end(1)
    assert end is not None and end < 96, ids
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, repetition_detection=rule)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert list(out.token_ids) == ids[:end]
    assert (out.finish_reason, out.stop_reason) == ("stop", "repetition_detected")
    # The token that completes the loop keeps its text (as vLLM's): only an EOS or a stop id has none.
    capped = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=end, ignore_eos=True))
    assert out.text == capped[0].outputs[0].text
    later = first_end(end + 1)
    assert later is not None, ids
    params.min_tokens = end + 1
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert list(out.token_ids) == ids[:later] and out.stop_reason == "repetition_detected"


def test_a_stop_string_on_the_repeating_token_wins(llm) -> None:
    """The token that completes a repetition keeps its text, so it may complete a stop string too: the
    stop string then ends the request (vLLM looks for stop strings after its engine stopped), its text
    cut there or kept with ``include_stop_str_in_output``."""
    piece = llm.tokenizer.decode([5])
    rule = {"max_pattern_size": 1, "min_count": 3}
    base = {"temperature": 0.0, "max_tokens": 10, "logit_bias": {5: 100.0}, "repetition_detection": rule}
    out = llm.generate(PROMPT, SamplingParams(**base))[0].outputs[0]
    assert (list(out.token_ids), out.text, out.stop_reason) == ([5, 5, 5], piece * 3, "repetition_detected")
    for keep, text in ((False, ""), (True, piece * 3)):
        params = SamplingParams(**base, stop=[piece * 3], include_stop_str_in_output=keep)
        out = llm.generate(PROMPT, params)[0].outputs[0]
        assert (list(out.token_ids), out.text) == ([5, 5, 5], text)
        assert (out.finish_reason, out.stop_reason) == ("stop", piece * 3)


def test_logprob_token_ids_offline(llm) -> None:
    """``logprob_token_ids``: per position the sampled token, then exactly the named ids in their order,
    with the values and ranks a ``logprobs=20`` run of the same greedy output reports (a rare id: its
    true rank, past 20)."""
    wide = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, logprobs=20))[0].outputs[0]
    first = wide.logprobs[0]
    by_rank = sorted((lp.rank, tid) for tid, lp in first.items())
    named = [by_rank[9][1], 997, by_rank[2][1]]
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=0, logprob_token_ids=named)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.token_ids == wide.token_ids
    for sampled, part, full in zip(out.token_ids, out.logprobs, wide.logprobs, strict=True):
        assert list(part) == [sampled] + [t for t in named if t != sampled]
        for tid, lp in part.items():
            if tid in full:
                assert (lp.logprob, lp.rank) == (full[tid].logprob, full[tid].rank)
            else:
                assert lp.rank > 20 and lp.logprob < min(v.logprob for v in full.values())
    with pytest.raises(ValueError, match="logprob_token_ids needs logprobs"):
        llm.generate(PROMPT, SamplingParams(max_tokens=2, logprob_token_ids=[5]))
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate(PROMPT, SamplingParams(max_tokens=2, logprobs=0, logprob_token_ids=[10**6]))
