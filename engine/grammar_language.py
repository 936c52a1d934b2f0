"""Whether a structured-outputs grammar has any sentence at all, read from xgrammar's serialized
grammar (``Grammar.serialize_json``): a constraint with none (``a[^\\s\\S]``, a rule with no way
to end) is refused before it runs instead of ending its request at a dead end.

It reads one layout of xgrammar's (``_XGR_LAYOUT``); on any other, and for any part it does not
know, it answers "has a sentence": it may let an empty grammar through (met at run time:
``RequestGrammar.dead_end``), never refuse one that has a sentence.
"""

from __future__ import annotations

import json

# The layout of xgrammar's serialized grammar read by ``has_sentence``: its expression kinds.
_XGR_LAYOUT = "v18"
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE, _SEQUENCE, _CHOICES, _REPEAT = 0, 1, 2, 3, 4, 5, 6, 8
_MAX_CHAR = 0x10FFFF


def has_sentence(serialized: str) -> bool:
    """Whether a grammar (xgrammar's ``serialize_json``) derives some text: the rules that do are
    found by a fixpoint (a rule does when its body does; a sequence when all its items do, choices
    when one does, a character class when it holds a character, a repetition when it may be absent
    or its rule does), each rule looked at again only when a rule it refers to is found to. Anything
    else this reader does not know (another layout, tag dispatch, regexes, tokens, lookaheads)
    counts as deriving text: it may call a grammar live that is not, never the other way round."""
    grammar = json.loads(serialized)
    if grammar.get("__VERSION__") != _XGR_LAYOUT:
        return True
    data = grammar["grammar_expr_data"]
    starts = [*grammar["grammar_expr_indptr"], len(data)]  # where each expression starts, and the end
    bodies = [rule[1] for rule in grammar["rules"]]
    live = [False] * len(bodies)

    def parts(expr: int) -> tuple[int, int, list[int]]:
        return data[starts[expr]], data[starts[expr] + 1], data[starts[expr] + 2 : starts[expr + 1]]

    def derives(expr: int) -> bool:
        kind, n, args = parts(expr)
        if kind == _CLASS:
            ranges = sorted(zip(args[1:n:2], args[2:n:2], strict=True))
            if not args[0]:
                return any(lo <= hi for lo, hi in ranges)
            covered = -1  # the highest character the negated ranges cover from 0 on
            for lo, hi in ranges:
                if lo > covered + 1:
                    return True
                covered = max(covered, hi)
            return covered < _MAX_CHAR
        if kind == _RULE:
            return live[args[0]]
        if kind == _SEQUENCE:
            return all(derives(e) for e in args[:n])
        if kind == _CHOICES:
            return any(derives(e) for e in args[:n])
        if kind == _REPEAT:
            return args[1] == 0 or live[args[0]]
        return True  # bytes, the empty string, a starred class, and what this reader does not know

    def refers_to(expr: int, found: set[int]) -> set[int]:
        kind, n, args = parts(expr)
        if kind in (_RULE, _REPEAT):
            found.add(args[0])
        elif kind in (_SEQUENCE, _CHOICES):
            for e in args[:n]:
                refers_to(e, found)
        return found

    try:
        users: list[set[int]] = [set() for _ in bodies]
        for rule, body in enumerate(bodies):
            for used in refers_to(body, set()):
                users[used].add(rule)
        todo = list(range(len(bodies)))
        while todo:
            rule = todo.pop()
            if not live[rule] and derives(bodies[rule]):
                live[rule] = True
                todo.extend(users[rule])
        return live[grammar["root_rule_id"]]
    except (IndexError, KeyError, TypeError, ValueError, RecursionError):  # a layout misread: no verdict
        return True
