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
``allOf`` of conflicting members, a first token mask that is empty). The checks run where the
compile runs, once per distinct constraint.

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
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from engine.grammar_limits import choice_problem, regex_problem, schema_problem
from engine.grammar_matcher import BudgetedGrammar, RequestGrammar
from engine.grammar_rewrites import (
    ebnf_grammar,
    json_grammar,
    marked_patterns,
    marked_tag_patterns,
    regex_automaton,
    regex_utf8,
)
from engine.json_schema_merge import declare_required, merge_all_of
from engine.json_schema_support import map_tag_schemas, tag_schemas, unenforced_keyword
from engine.sampling_params import StructuredOutputsParams

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
                info = _special_tokens_apart(info, hf, self._tokenizer.all_special_ids, self.vocab_size)
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
        self._check_satisfiable(compiled, kind)
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
                compiled = _compile_json_schema(compiler, schema, any_ws)
            elif kind == "json_object":
                compiled = _compile_json_schema(compiler, '{"type": "object"}', any_ws)
            elif kind == "regex":
                compiled = _compile_regex(compiler, spec.regex or "")
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(spec.choice or ()))
            elif kind == "structural_tag":
                compiled = _compile_structural_tag(compiler, schema)
            else:
                compiled = _compile_ebnf(compiler, spec.grammar or "")
        except (RuntimeError, ValueError, TypeError, KeyError, RecursionError) as e:
            raise ValueError(f"invalid structured outputs {kind}: {_reason(e)}") from e
        return compiled

    def _check_satisfiable(self, compiled: Any, kind: str) -> None:
        """ValueError when no first token is allowed (``root ::= root``, ``[^\\s\\S]``, or text the
        vocabulary cannot spell): the request would otherwise start and be aborted at its first token.
        Not a proof that some output completes, but what would abort every request at once."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()):
            raise ValueError(f"invalid structured outputs {kind}: no output of this model can satisfy it")

    def matcher(self, compiled: xgr.CompiledGrammar, after_token_id: int | None = None) -> RequestGrammar:
        """A request's matcher; one whose cost a token is checked when there is a budget."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        if self.mask_budget_ms > 0:
            return BudgetedGrammar(matcher, self.stop_token_ids, after_token_id, self.mask_budget_ms)
        return RequestGrammar(matcher, self.stop_token_ids, after_token_id)


def _special_tokens_apart(info: Any, hf: Any, special_ids: set[int], vocab_size: int) -> Any:
    """``info`` with the vocabulary's special tokens (``<|im_start|>``) written as no text, which
    xgrammar then never takes as part of a sentence (its own special tokens; a stop token still
    ends one). As their text, a regex's "." or a JSON string's character took them, and the
    detokenizer, which skips special tokens, wrote text that no longer matched: ``.{3,}`` gave ""."""
    import xgrammar as xgr

    special = [i for i in special_ids if i < vocab_size]
    if not special:
        return info
    vocab = [""] * vocab_size
    for token, i in hf.get_vocab().items():
        if i < vocab_size:
            vocab[i] = token
    for i in special:
        vocab[i] = ""
    return xgr.TokenizerInfo(
        vocab,
        vocab_type=info.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=info.stop_token_ids,
        add_prefix_space=info.add_prefix_space,
    )


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


def _compile_json_schema(compiler: Any, schema: str | None, any_ws: bool) -> Any:
    """xgrammar's grammar for ``schema``, its length-bounded strings made valid JSON (as xgrammar
    writes them they may hold raw control characters: mlc-ai/xgrammar#800) and its long "at least"
    repetitions matched in constant time a token, its patterns matched as JSON text
    (``engine/grammar_rewrites.py``)."""
    import xgrammar as xgr

    marked, patterns = marked_patterns(schema or "{}")
    fixed = json_grammar(str(xgr.Grammar.from_json_schema(marked, any_whitespace=any_ws)), patterns)
    if fixed is None:  # nothing to fix, or an xgrammar that writes it otherwise: as it compiles it
        return compiler.compile_json_schema(schema or "{}", any_whitespace=any_ws)
    return compiler.compile_grammar(fixed)


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


def _compile_regex(compiler: Any, regex: str) -> Any:
    """xgrammar's grammar for ``regex`` as an automaton (``regex_automaton``), or, where that does
    not build (too large), as ``compile_regex`` makes it. Its errors are ``compile_regex``'s, whose
    reader refuses what xgrammar cannot match (lookarounds, backreferences…): the automaton's
    would ignore a lookahead."""
    import xgrammar as xgr

    xgr.Grammar.from_regex(regex)
    try:
        return compiler.compile_grammar(regex_automaton(regex))
    except (RuntimeError, ValueError):
        return compiler.compile_regex(regex_utf8(regex))


def _compile_ebnf(compiler: Any, grammar: str) -> Any:
    """The client's EBNF ``grammar``, its character classes and regexes matching no surrogate (as
    xgrammar reads "[^x]" it takes a surrogate's UTF-8 form, which is no UTF-8): rewritten as
    xgrammar prints it (``ebnf_grammar``), or as it came where that does not compile."""
    import xgrammar as xgr

    fixed = ebnf_grammar(str(xgr.Grammar.from_ebnf(grammar)))
    if fixed is not None:
        try:
            return compiler.compile_grammar(fixed)
        except (RuntimeError, ValueError):  # a grammar xgrammar prints but cannot read back
            pass
    return compiler.compile_grammar(grammar)


def _compile_structural_tag(compiler: Any, text: str | None) -> Any:
    """xgrammar's structural tag: its own format (``{"type": "structural_tag", "format": …}``), or
    the older one vLLM also takes, ``structures`` of ``{"begin", "schema", "end"}`` and ``triggers``."""
    import xgrammar as xgr

    tag, patterns = marked_tag_patterns(json.loads(text or "{}"))  # as a json constraint's are
    if "structures" not in tag:
        args: tuple[Any, ...] = (json.dumps(tag),)
    else:
        if not isinstance(tag["structures"], list) or not isinstance(tag.get("triggers"), list):
            raise ValueError("structures and triggers must be lists")
        items = [
            xgr.StructuralTagItem(
                begin=s["begin"],
                schema=s["schema"] if isinstance(s["schema"], str) else json.dumps(s["schema"]),
                end=s["end"],
            )
            for s in tag["structures"]
        ]
        args = (items, tag["triggers"])
    with warnings.catch_warnings():  # the older form is deprecated in xgrammar, not in vLLM's API
        warnings.simplefilter("ignore", DeprecationWarning)
        # Its schemas' length-bounded strings made valid JSON, as a json constraint's are.
        fixed = json_grammar(str(xgr.Grammar.from_structural_tag(*args)), patterns)
        return compiler.compile_structural_tag(*args) if fixed is None else compiler.compile_grammar(fixed)
