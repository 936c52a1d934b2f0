"""Structured outputs: sampling constrained to a JSON schema, a regex, a choice or an EBNF grammar.

xgrammar does the work (as in vLLM and SGLang): a ``CompiledGrammar`` per distinct constraint,
compiled once against the model's vocabulary and kept in a small LRU; a ``GrammarMatcher`` per
sequence that says which tokens may come next (a bitmask over the vocabulary) and advances by
each sampled token. A request owns its matcher like its tokens, so preemption, recompute and
resume need nothing special: the matcher has seen exactly the request's output tokens.

When a grammar is complete it allows only the model's stop (EOS) tokens; accepting one ends the
request with ``finish_reason="stop"`` whatever ``ignore_eos`` says (there is nothing left to write).

Compiling may take milliseconds to seconds for a large schema, so the async engine compiles in a
worker thread, never on the event loop or the engine thread; the engine thread only fills masks
and advances matchers (microseconds per token; a grammar that costs more is ended as it runs:
``engine/grammar_matcher.py``). At most ``MAX_CONCURRENT_COMPILES`` compiles run at once (xgrammar's
compile releases the GIL), so a trivial schema never waits behind one costly compile; requests for
the same constraint share one compile.

A JSON schema's ``allOf`` is merged into one schema first (xgrammar enforces none of more than one
member), and that merged schema is compiled: a json constraint's, and each one a structural tag holds.

A constraint is refused (ValueError, a 400 at the HTTP edge) rather than half applied: a JSON
schema using a keyword xgrammar compiles but does not enforce, or an ``allOf`` that cannot be
merged soundly (``engine/json_schema_support.py``), and a constraint no output can satisfy (an
``allOf`` of conflicting members, a first token mask that is empty, a grammar with no sentence at
all: ``a[^\\s\\S]``, a rule with no way to end). The checks run where the compile runs, once per
distinct constraint. A constraint with a sentence may still have a branch that leads nowhere (a
grammar rule ``r ::= "x" r``); a request that takes one is ended as it meets it
(``RequestGrammar.dead_end``).

How each kind is turned into xgrammar's grammar is ``engine/grammar_kinds.py``.

A constraint whose grammar would cost the engine thread milliseconds a token, or the compiler
seconds, is refused before it compiles (``engine/grammar_limits.py``: long counted repetitions in
regexes, many optional properties, long enums, many anyOf members); where an equivalent grammar is
cheap, that one is compiled instead (a regex as an automaton, JSON's "at least n" repetitions
unambiguous, a bounded string's characters as one character class).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from engine.grammar_kinds import compile_ebnf, compile_json_schema, compile_regex, compile_structural_tag
from engine.grammar_language import has_sentence
from engine.grammar_limits import choice_problem, regex_problem, schema_problem
from engine.grammar_matcher import BudgetedGrammar, RequestGrammar
from engine.grammar_rewrites import marked_patterns, marked_tag_patterns
from engine.grammar_vocab import special_tokens_apart
from engine.json_schema_merge import declare_required, merge_all_of
from engine.json_schema_support import unenforced_keyword
from engine.sampling_params import StructuredOutputsParams
from engine.structural_tag_schemas import map_tag_schemas, tag_schemas

if TYPE_CHECKING:
    import xgrammar as xgr

    from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Compiles running at once, each on at most a quarter of the cores (at least one thread): a costly
# compile (thousands of optional properties took 16 s here) then holds one slot while a trivial
# schema compiles in the other, and compiles never take more than about half the cores (both of
# a 2-core machine while two run at once) from the engine's steps.
MAX_CONCURRENT_COMPILES = 2
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a
# "Check failed: (...) is false: " clause; the client needs only the reason after them.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(?:Check failed:.*? is false:\s*)?", re.S)


def _reason(error: BaseException) -> str:
    text = str(error).strip()
    return _XGR_PREFIX.sub("", text).strip() or type(error).__name__


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one model's vocabulary; thread-safe, with an LRU.

    The vocabulary table is built on first use (it walks the whole vocabulary), so a replica that
    never sees a structured request never pays for it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = 256,
        mask_budget_ms: float = 0.0,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        # A request's grammar may cost the engine thread this many ms a token (0: no limit).
        self.mask_budget_ms = mask_budget_ms
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputsParams, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the compiles in flight; held for microseconds
        self._building = threading.Lock()  # the vocabulary table, built once (seconds, 150k vocab)
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT_COMPILES)
        # Each constraint being compiled now, with its result to come: a second request for it
        # waits for that (holding no slot) instead of compiling it again.
        self._in_flight: dict[StructuredOutputsParams, Future[xgr.CompiledGrammar]] = {}
        self._running: list[StructuredOutputsParams] = []  # those holding a slot
        self._compiler: xgr.GrammarCompiler | None = None

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        with self._building:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                # A copy: the wrapper may reconfigure the tokenizer object it is given.
                backend = type(self._tokenizer.backend).from_str(self._tokenizer.backend.to_str())
                hf = PreTrainedTokenizerFast(tokenizer_object=backend)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                info = special_tokens_apart(info, hf, self._tokenizer.all_special_ids, self.vocab_size)
                threads = max(1, min(8, (os.cpu_count() or 1) // 2) // MAX_CONCURRENT_COMPILES)
                # Our own LRU holds the results; xgrammar's cache would keep a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            return self._compiler

    def cached(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar | None:
        """The compiled grammar of ``spec`` if it is at hand (never compiles: safe on any thread)."""
        spec = spec.grammar_key
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
            return hit

    @property
    def compiling(self) -> list[StructuredOutputsParams]:
        """The constraints xgrammar is compiling now (each once, however many requests wait for it;
        not those waiting for a free slot)."""
        with self._lock:
            return list(self._running)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``; ValueError with the reason when it is not a valid one.
        A constraint another thread is compiling now is waited for, not compiled again."""
        spec = spec.grammar_key
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            pending = self._in_flight.get(spec)
            if pending is None:
                mine: Future[xgr.CompiledGrammar] = Future()
                self._in_flight[spec] = mine
        if pending is not None:
            try:
                return pending.result()
            except ValueError as e:  # the same refusal, raised anew in this thread
                raise ValueError(str(e)) from None
        try:
            compiled = self._compile_new(spec)
        except BaseException as e:
            mine.set_exception(e)
            raise
        finally:
            with self._lock:  # after the cache has it: a later request finds one or the other
                del self._in_flight[spec]
        mine.set_result(compiled)
        return compiled

    def _compile_new(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        spec.validate()
        compiler = self._xgr_compiler()
        kind = spec.kind
        any_ws = not spec.disable_any_whitespace
        # The text compiled, where rewritten: a json schema, or a structural tag with its schemas.
        schema = (
            _json_schema(spec)
            if kind == "json"
            else _structural_tag(spec)
            if kind == "structural_tag"
            else None
        )
        costly = _costly(spec, kind, schema)
        if costly is not None:
            raise ValueError(f"structured outputs {kind} {costly}")
        with self._slots:
            with self._lock:
                self._running.append(spec)
            try:
                compiled = self._compile(compiler, spec, kind, any_ws, schema)
            finally:
                with self._lock:
                    self._running.remove(spec)
        problem = _unenforced(spec, kind, schema)
        if problem is not None:
            raise ValueError(f"structured outputs {kind} {problem}, which structured outputs cannot enforce")
        self._check_satisfiable(compiled, spec, kind, schema)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(
        self, compiler: Any, spec: StructuredOutputsParams, kind: str, any_ws: bool, schema: str | None
    ) -> Any:
        try:
            if kind == "json":
                compiled = compile_json_schema(compiler, schema, any_ws)
            elif kind == "json_object":
                compiled = compile_json_schema(compiler, '{"type": "object"}', any_ws)
            elif kind == "regex":
                compiled = compile_regex(compiler, spec.regex or "")
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(spec.choice or ()))
            elif kind == "structural_tag":
                compiled = compile_structural_tag(compiler, schema)
            else:
                compiled = compile_ebnf(compiler, spec.grammar or "")
        except (RuntimeError, ValueError, TypeError, KeyError, RecursionError) as e:
            raise ValueError(f"invalid structured outputs {kind}: {_reason(e)}") from e
        return compiled

    def _check_satisfiable(
        self, compiled: Any, spec: StructuredOutputsParams, kind: str, schema: str | None
    ) -> None:
        """ValueError when no first token is allowed (``root ::= root``, ``[^\\s\\S]``, or text the
        vocabulary cannot spell), or when the grammar has no sentence at all (``a[^\\s\\S]``,
        ``root ::= "a" r`` with ``r ::= r "b"``, a JSON pattern ``^a[^\\s\\S]$``: ``has_sentence``):
        the request would otherwise start and end at a dead end (``RequestGrammar.dead_end``). Not
        a proof that the model can spell a sentence, or that every branch has one: those dead ends
        are met as the request runs."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()):
            raise ValueError(f"invalid structured outputs {kind}: no output of this model can satisfy it")
        # The constraint as xgrammar reads it, not the compiled grammar: that one holds its
        # automata (hundreds of MB serialized for a schema of 400 patterns), and a regex compiles
        # to one automaton this reader cannot look into. Of a JSON schema (or a structural tag's)
        # only the patterns are read: each is matched as JSON text, which writes every character
        # it matches (a quote as an escape: ``engine/grammar_pattern_json.py``), so a pattern has
        # a sentence there when it has one at all.
        if kind == "regex":
            grammar = xgr.Grammar.from_regex(spec.regex or "")
        elif kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(spec.grammar or "")
        else:
            for pattern in _patterns(kind, schema):
                try:
                    live = has_sentence(xgr.Grammar.from_regex(pattern).serialize_json())
                except (RuntimeError, ValueError):  # a pattern xgrammar reads otherwise: no verdict
                    continue
                if not live:
                    raise ValueError(
                        f"invalid structured outputs {kind}: the pattern {pattern!r} matches no text "
                        "(every way through it needs an empty character class such as [^\\s\\S])"
                    )
            return
        if not has_sentence(grammar.serialize_json()):
            raise ValueError(
                f"invalid structured outputs {kind}: no output can satisfy it (every way through it "
                "needs an empty character class such as [^\\s\\S], or a rule with no way to end)"
            )

    def matcher(self, compiled: xgr.CompiledGrammar, after_token_id: int | None = None) -> RequestGrammar:
        """A request's matcher; one whose cost a token is checked when there is a budget."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        if self.mask_budget_ms > 0:
            return BudgetedGrammar(
                matcher, self.stop_token_ids, after_token_id, self.mask_budget_ms, vocab_size=self.vocab_size
            )
        return RequestGrammar(matcher, self.stop_token_ids, after_token_id, vocab_size=self.vocab_size)


def _patterns(kind: str, schema: str | None) -> list[str]:
    """The regexes (``pattern``, ``patternProperties`` names) in a json constraint's schema text or
    a structural tag's schemas, as ``marked_patterns`` finds them."""
    if kind == "json":
        return marked_patterns(schema or "{}")[1]
    if kind == "structural_tag":
        return marked_tag_patterns(json.loads(schema or "{}"))[1]
    return []


def _rewritten(schema: Any) -> Any:
    """``schema`` with any ``allOf`` merged and the required properties its objects do not
    declare declared; ValueError as ``_json_schema`` says."""
    return declare_required(merge_all_of(schema))


def _rewrite(text: str, kind: str, rewrite: Callable[[Any], Any]) -> str:
    """``text`` decoded, rewritten and encoded again; as it came when it is not JSON (the compile
    says so). ValueError, naming the constraint ``kind``, when the rewrite refuses it."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    try:
        return json.dumps(rewrite(value))
    except ValueError as e:
        raise ValueError(f"structured outputs {kind} {e}") from e


def _structural_tag(spec: StructuredOutputsParams) -> str:
    """The structural tag text compiled: its own, with each JSON schema in it rewritten as a json
    constraint's is (``_json_schema``)."""
    text = spec.structural_tag or "{}"
    if "allOf" not in text and "required" not in text:  # (a schema may be JSON text in the tag's)
        return text
    return _rewrite(text, "structural_tag", lambda tag: map_tag_schemas(tag, _rewritten))


def _json_schema(spec: StructuredOutputsParams) -> str:
    """The JSON schema text a json constraint compiles: its own, with any ``allOf`` merged and the
    required properties its objects do not declare declared. ValueError when an allOf cannot be
    merged soundly, or no JSON value satisfies it or an object's required names."""
    text = spec.json or "{}"
    if '"allOf"' not in text and '"required"' not in text:  # as it came: no reason to rewrite it
        return text
    return _rewrite(text, "json", _rewritten)


def _schemas(kind: str, schema: str | None) -> list[Any]:
    """The JSON schemas of a json constraint (``schema``: its text as compiled) or of a structural
    tag's, decoded; a tag's schema given as text that is not JSON is left to the compile."""
    if kind == "json":
        return [json.loads(schema or "{}")]
    if kind != "structural_tag":
        return []
    found = []
    for item in tag_schemas(json.loads(schema or "{}")):
        try:
            found.append(json.loads(item) if isinstance(item, str) else item)
        except ValueError:
            continue
    return found


def _unenforced(spec: StructuredOutputsParams, kind: str, schema: str | None) -> str | None:
    """What in the constraint's JSON schemas (``schema``: the json one, as compiled) its grammar
    would not enforce, or None."""
    return next((found for found in map(unenforced_keyword, _schemas(kind, schema)) if found), None)


def _costly(spec: StructuredOutputsParams, kind: str, schema: str | None) -> str | None:
    """What in the constraint is past one of ``engine/grammar_limits.py``'s limits (its grammar
    would cost the engine thread milliseconds a token, or the compiler seconds), or None."""
    if kind == "regex":
        return regex_problem(spec.regex or "")
    if kind == "choice":
        return choice_problem(spec.choice or ())
    return next((found for found in map(schema_problem, _schemas(kind, schema)) if found), None)
