"""IncrementalDetokenizer: streamed text equals the one-shot decode, cut at stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_helpers import build_metaspace_dir

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama)


@pytest.fixture(scope="module")
def ms_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """SentencePiece-style: "▁" spaces, <0xNN> byte fallback, leading space stripped by the decoder."""
    return Tokenizer.from_dir(build_metaspace_dir(tmp_path_factory.mktemp("metaspace")))


def reference(tok: Tokenizer, ids: list[int], params: SamplingParams) -> tuple[str, str | None]:
    """One-shot decode, cut where a reader first sees a stop string (earliest end, then longest)."""
    text = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
    best = None
    for stop in params.stop:
        at = text.find(stop) if stop else -1
        if at >= 0 and (best is None or (at + len(stop), at) < (best[1] + len(best[0]), best[1])):
            best = (stop, at)
    if best is None:
        return text, None
    stop, at = best
    return text[: at + len(stop)] if params.include_stop_str_in_output else text[:at], stop


def stream(
    tok: Tokenizer, ids: list[int], params: SamplingParams, chunks: list[int], prompt: list[int] | None = None
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, params, prompt or [])
    deltas, i, c = [], 0, 0
    while i < len(ids):
        n = chunks[c % len(chunks)] if chunks else 1
        c += 1
        deltas.append(detok.append(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas, detok


def test_multibyte_characters_are_emitted_whole(tok: Tokenizer) -> None:
    ids = tok.encode("é😀a")
    assert len(ids) == 7
    detok = IncrementalDetokenizer(tok, SamplingParams(), [])
    deltas = [detok.append([i]) for i in ids]
    assert deltas == ["", "é", "", "", "", "😀", "a"]
    assert detok.flush() == ""
    assert detok.text == "é😀a"


def test_incomplete_character_at_the_end_is_flushed_as_one_shot_decode(tok: Tokenizer) -> None:
    ids = tok.encode("a😀")[:-2]  # the emoji's last two byte tokens never come
    detok = IncrementalDetokenizer(tok, SamplingParams(), [])
    assert detok.append(ids) == "a"
    assert detok.flush() == tok.decode(ids)[1:] == "\ufffd"


def test_stop_string_across_tokens_is_held_back_then_removed(tok: Tokenizer) -> None:
    params = SamplingParams(stop=["STOP"])
    detok = IncrementalDetokenizer(tok, params, [])
    out = []
    for piece in ["abc S", "T", "O", "P more"]:
        out.append(detok.append(tok.encode(piece)))
    assert "".join(out) == "abc "
    assert out[0] == "abc "  # "S" is held: it may start "STOP"
    assert out[1:] == ["", "", ""]
    assert detok.stop_hit == "STOP"
    assert detok.append(tok.encode("x")) == "" and detok.flush() == ""
    assert detok.text == "abc "


def test_held_text_is_released_when_it_stops_matching(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["STOP"]), [])
    assert detok.append(tok.encode("x ST")) == "x "
    assert detok.held_back == "ST"
    assert detok.append(tok.encode("ay")) == "STay"
    assert detok.stop_hit is None
    assert detok.append(tok.encode(" ST")) == " "
    assert detok.flush() == "ST"  # finished for another reason: nothing stays held


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    params = SamplingParams(stop=["\n\n", "end"], include_stop_str_in_output=True)
    deltas, detok = stream(tok, tok.encode("line one\n\nline two end"), params, [1])
    assert "".join(deltas) == "line one\n\n"
    assert detok.stop_hit == "\n\n"


def test_earliest_ending_stop_wins(tok: Tokenizer) -> None:
    # "bc" completes before "abcd" would: a char-by-char reader stops at "bc".
    params = SamplingParams(stop=["abcd", "bc"])
    deltas, detok = stream(tok, tok.encode("xabcd"), params, [5])
    assert "".join(deltas) == "xa" and detok.stop_hit == "bc"


def test_special_tokens_skipped_or_shown(tok: Tokenizer) -> None:
    ids = tok.encode("hi<|im_end|>there")
    assert 2 in ids
    assert "".join(stream(tok, ids, SamplingParams(), [1])[0]) == "hithere"
    shown = "".join(stream(tok, ids, SamplingParams(skip_special_tokens=False), [1])[0])
    assert shown == "hi<|im_end|>there"


def test_stop_terminated_token_text_is_left_out(tok: Tokenizer) -> None:
    params = SamplingParams(skip_special_tokens=False)
    detok = IncrementalDetokenizer(tok, params, [])
    assert detok.append(tok.encode("ok<|im_end|>"), stop_terminated=True) == "ok"
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tok, params, [])
    assert detok.append(tok.encode("ok<|im_end|>"), stop_terminated=True) == "ok<|im_end|>"


def test_prompt_context_does_not_leak_into_output(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>user\nsay é<|im_end|>\n<|im_start|>assistant\n")
    out = tok.encode("Sure: é 😀")
    deltas, detok = stream(tok, out, SamplingParams(), [1], prompt=prompt)
    assert "".join(deltas) == detok.text == "Sure: é 😀"
    # A prompt that ends inside a multi-byte character does not disturb the output either.
    deltas, _ = stream(tok, out, SamplingParams(), [1], prompt=tok.encode("x😀")[:-2])
    assert "".join(deltas) == "Sure: é 😀"


def test_window_stays_small_on_long_outputs(tok: Tokenizer) -> None:
    ids = tok.encode("def function(argument):\n    return argument * 2  # é 😀\n" * 60)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(tok, SamplingParams(), [])
    total = "".join(detok.append([i]) for i in ids) + detok.flush()
    assert total == tok.decode(ids)
    assert len(detok._ids) <= 80  # decoding work per token is bounded, not growing with the output


@st.composite
def cases(draw: st.DrawFn, vocab: int) -> tuple[list[int], list[int], list[int], dict]:
    # Ids skewed toward low ids (special tokens 0..2 and single bytes) to split characters often.
    ids = draw(st.lists(st.one_of(st.integers(0, 300), st.integers(0, vocab - 1)), min_size=0, max_size=40))
    prompt = draw(st.lists(st.integers(0, vocab - 1), max_size=8))
    chunks = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    opts = dict(skip_special_tokens=draw(st.booleans()), include_stop_str_in_output=draw(st.booleans()))
    return ids, prompt, chunks, opts


@st.composite
def valid_byte_run_ids(draw: st.DrawFn, tok: Tokenizer) -> list[int]:
    """Ids for a byte-fallback tokenizer: encoded text (so byte-token runs are whole characters)
    mixed with arbitrary non-byte tokens."""
    first_byte_id = min(i for i in range(tok.vocab_size) if tok.convert_ids_to_tokens([i])[0] == "<0x00>")
    ids: list[int] = []
    for _ in range(draw(st.integers(0, 8))):
        if draw(st.booleans()):
            ids += tok.encode(draw(st.text(alphabet="ab é😀中\n", max_size=6)), add_special_tokens=False)
        else:
            ids.append(draw(st.integers(0, first_byte_id - 1)))
    return ids


def check_streaming(tok: Tokenizer, data: st.DataObject, with_prompt: bool) -> None:
    ids, prompt, chunks, opts = data.draw(cases(tok.vocab_size))
    if not with_prompt:
        # SentencePiece style: see the module docstring of engine.detokenizer on byte-fallback runs.
        prompt = []
        ids = data.draw(valid_byte_run_ids(tok))
    full = tok.decode(ids, skip_special_tokens=opts["skip_special_tokens"])
    # Stop strings: substrings of the real text (so they do match), plus arbitrary short strings.
    stops = []
    for _ in range(data.draw(st.integers(0, 3))):
        if full and data.draw(st.booleans()):
            a = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[a : a + data.draw(st.integers(1, 6))])
        else:
            stops.append(data.draw(st.text(alphabet="ab \n\ufffdé<|>", min_size=1, max_size=4)))
    params = SamplingParams(stop=stops, **opts)
    expected, expected_stop = reference(tok, ids, params)

    detok = IncrementalDetokenizer(tok, params, prompt)
    emitted, i, c = "", 0, 0
    while i < len(ids):
        n = chunks[c % len(chunks)]
        c += 1
        emitted += detok.append(ids[i : i + n])
        i += n
        # Never emit text that is later withdrawn (e.g. the start of a stop string).
        assert expected.startswith(emitted)
    emitted += detok.flush()
    assert emitted == expected
    assert detok.stop_hit == expected_stop
    assert detok.text == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_text_equals_one_shot_reference(tok: Tokenizer, data: st.DataObject) -> None:
    check_streaming(tok, data, with_prompt=True)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_text_equals_one_shot_reference_sentencepiece(
    ms_tok: Tokenizer, data: st.DataObject
) -> None:
    # Without a prompt: with one, the first output token keeps its leading space (see below),
    # which a one-shot decode of the output alone strips.
    check_streaming(ms_tok, data, with_prompt=False)


def test_sentencepiece_output_reads_as_a_continuation_of_the_prompt(ms_tok: Tokenizer) -> None:
    prompt = ms_tok.encode("Say hi")
    out = ms_tok.encode("Say hi Hello é", add_special_tokens=False)[len(prompt) - 1 :]
    assert ms_tok.convert_ids_to_tokens(out)[0].startswith("▁")
    deltas, detok = stream(ms_tok, out, SamplingParams(), [1], prompt=prompt)
    assert "".join(deltas) == detok.text == " Hello é"
    assert ms_tok.decode(out) == "Hello é"  # alone, the decoder strips the leading space


def test_stop_strings_wait_for_min_tokens(tok: Tokenizer) -> None:
    """As vLLM: a stop string counts only once more than min_tokens ids are out."""
    pieces = ["STOP", " a", " STOP", " b"]
    ids = [tok.encode(p) for p in pieces]
    params = SamplingParams(stop=["STOP"], min_tokens=len(ids[0]) + len(ids[1]))
    detok = IncrementalDetokenizer(tok, params, [])
    assert detok.append(ids[0]) == "STOP"  # within min_tokens: kept, not a stop
    assert detok.stop_hit is None
    assert detok.append(ids[1]) == " a"
    assert detok.append(ids[2]) == " " and detok.stop_hit == "STOP"
    assert detok.text == "STOP a "
    # Without min_tokens the first one stops at once.
    early = IncrementalDetokenizer(tok, SamplingParams(stop=["STOP"]), [])
    assert early.append(ids[0]) == "" and early.stop_hit == "STOP"


def test_stop_string_straddling_the_min_tokens_boundary_is_found(tok: Tokenizer) -> None:
    first, second = tok.encode("x ST"), tok.encode("OP y")
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["STOP"], min_tokens=len(first)), [])
    assert detok.append(first) == "x "  # "ST" may still begin a stop that ends past min_tokens
    assert detok.append(second) == "" and detok.stop_hit == "STOP"
    assert detok.text == "x "
