"""How each kind of structured-outputs constraint is compiled with xgrammar: a JSON schema, a
regex, an EBNF grammar and a structural tag, each through the rewrites of
``engine/grammar_rewrites.py`` that make its grammar sound (valid JSON, valid UTF-8, cheap a token).

``engine/structured_output.py`` decides what is compiled (merged schemas, limits, refusals) and
keeps the results; this module only turns one constraint's text into a ``CompiledGrammar`` with a
given ``xgr.GrammarCompiler``. It never caches, never checks limits and holds no state.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from engine.grammar_pattern_json import json_text_regex
from engine.grammar_rewrites import (
    ebnf_grammar,
    json_grammar,
    marked_patterns,
    marked_tag_patterns,
    regex_automaton,
    regex_utf8,
)


def compile_json_schema(compiler: Any, schema: str | None, any_ws: bool) -> Any:
    """xgrammar's grammar for ``schema``, its length-bounded strings made valid JSON (as xgrammar
    writes them they may hold raw control characters: mlc-ai/xgrammar#800) and its long "at least"
    repetitions matched in constant time a token, its patterns matched as JSON text: escapes
    written for the quotes, backslashes and control characters they match
    (``engine/grammar_pattern_json.py``, ``engine/grammar_rewrites.py``)."""
    import xgrammar as xgr

    marked, patterns = marked_patterns(schema or "{}")
    patterns = [json_text_regex(p) for p in patterns]
    fixed = json_grammar(str(xgr.Grammar.from_json_schema(marked, any_whitespace=any_ws)), patterns)
    if fixed is None:  # nothing to fix, or an xgrammar that writes it otherwise: as it compiles it
        return compiler.compile_json_schema(schema or "{}", any_whitespace=any_ws)
    return compiler.compile_grammar(fixed)


def compile_regex(compiler: Any, regex: str) -> Any:
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


def compile_ebnf(compiler: Any, grammar: str) -> Any:
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


def compile_structural_tag(compiler: Any, text: str | None) -> Any:
    """xgrammar's structural tag: its own format (``{"type": "structural_tag", "format": …}``), or
    the older one vLLM also takes, ``structures`` of ``{"begin", "schema", "end"}`` and ``triggers``."""
    import xgrammar as xgr

    tag, patterns = marked_tag_patterns(json.loads(text or "{}"))  # as a json constraint's are
    patterns = [json_text_regex(p) for p in patterns]
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
