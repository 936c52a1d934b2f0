"""Compiles do not queue behind one another (``GrammarCompiler``: up to ``MAX_CONCURRENT_COMPILES`` at
once, xgrammar's compile releasing the GIL): a trivial schema issued while a costly one compiles
is ready first; two requests for one constraint share one compile. Orders are read from events
(what finished first), never from wall-clock thresholds.

The costly constraint is a real one just under the limits (``engine/grammar_limits.py``): an
``anyOf`` of 400 string patterns, each a counted repetition of 100 (limits: 1024 members, 128),
which xgrammar compiles in ~2 s with the tests' 1000-token vocabulary on a 2-core box."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from engine.grammar_limits import MAX_BRANCHES, MAX_REPEAT
from engine.sampling_params import StructuredOutputsParams as SO
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer


def _costly_schema(salt: str) -> dict:
    words = [f"{salt}{i:03d}" for i in range(400)]
    return {"anyOf": [{"type": "string", "pattern": f"^{w}[a-z]{{1,100}}$"} for w in words]}


def _costly(salt: str) -> SO:
    return SO(json=_costly_schema(salt))


@pytest.fixture
def grammars(tiny_llama: Path) -> GrammarCompiler:
    """A fresh compiler (an empty cache) with its vocabulary table built."""
    tokenizer = Tokenizer.from_dir(tiny_llama)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    compiler.compile(SO(json={"type": "integer"}))
    return compiler


def _in_background(
    grammars: GrammarCompiler, spec: SO, name: str, done: list, results: dict
) -> threading.Thread:
    def run() -> None:
        results[name] = grammars.compile(spec)
        done.append(name)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _until_compiling(grammars: GrammarCompiler, specs: list[SO]) -> None:
    deadline = time.monotonic() + 60
    while grammars.compiling != [s.grammar_key for s in specs]:
        assert time.monotonic() < deadline, f"never compiling {specs}: {grammars.compiling}"
        time.sleep(0.001)


def test_the_costly_constraint_is_under_the_limits() -> None:
    assert len(_costly_schema("a")["anyOf"]) == 400 <= MAX_BRANCHES
    assert 100 <= MAX_REPEAT


def test_a_trivial_compile_is_not_held_up_by_a_costly_one(grammars) -> None:
    done: list[str] = []
    results: dict = {}
    costly = _in_background(grammars, _costly("w"), "costly", done, results)
    _until_compiling(grammars, [_costly("w")])
    trivial = grammars.compile(SO(json={"type": "boolean"}))
    # Ready while the costly one still compiles (one slot at a time would have it wait for that).
    assert grammars.compiling == [_costly("w").grammar_key]
    assert grammars.cached(SO(json={"type": "boolean"})) is trivial
    costly.join(120)
    assert done == ["costly"] and grammars.compiling == []
    assert grammars.cached(_costly("w")) is results["costly"]


def test_two_requests_for_one_constraint_share_one_compile(grammars) -> None:
    done: list[str] = []
    results: dict = {}
    first = _in_background(grammars, _costly("v"), "first", done, results)
    _until_compiling(grammars, [_costly("v")])
    second = _in_background(grammars, _costly("v"), "second", done, results)
    first.join(120)
    second.join(120)
    # One compile, its result handed to both (a second compile would be another object).
    assert sorted(done) == ["first", "second"]
    assert results["first"] is results["second"] is grammars.cached(_costly("v"))


def test_a_refusal_reaches_every_request_waiting_for_it(grammars) -> None:
    """A constraint refused after its compile (a keyword its grammar would not enforce) is refused
    to the request that waited for that compile too, and compiled again for a later one."""
    refused = SO(json={**_costly_schema("u"), "not": {"const": "u000a"}})
    errors: dict[str, str] = {}

    def run(name: str) -> None:
        try:
            grammars.compile(refused)
        except ValueError as e:
            errors[name] = str(e)

    first = threading.Thread(target=run, args=("first",), daemon=True)
    first.start()
    _until_compiling(grammars, [refused])
    second = threading.Thread(target=run, args=("second",), daemon=True)
    second.start()
    first.join(120)
    second.join(120)
    assert errors["first"] == errors["second"]
    assert errors["first"].startswith("structured outputs json uses the JSON Schema keyword 'not'")
    assert grammars.compiling == [] and grammars.cached(refused) is None
