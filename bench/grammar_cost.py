"""What a structured-output constraint costs: compile time, and the engine thread's time per token
(``fill_next_token_bitmask`` + ``accept_token``) along a valid output.

The engine thread fills every constrained row's token mask each step, so a grammar that costs
milliseconds a token slows every request in the batch. Each case is a constraint a user can send
(``response_format`` / ``structured_outputs`` json, regex, choice, EBNF grammar, structural tag)
and a valid output for it, tokenized with the demo BPE tokenizer (``engine.demo.build_model``,
trained to ``--vocab-size`` tokens: 1000 is the tests' tiny tokenizer; 32000 asks for as many as
the standard library's sources give, about 20k, where per-token costs show as they do at serving
sizes; they grow with the vocabulary). The output is walked token by token through a fresh
matcher, timing each token. Side by side:

* ``ferry``: ``GrammarCompiler.compile`` (its limits, a refusal being the 400 a client gets, and
  its rewrites to cheaper equivalent grammars);
* ``xgrammar``: xgrammar's own compile of the same constraint (``compile_json_schema``,
  ``compile_regex``, the choice's alternation, ``compile_grammar``, ``compile_structural_tag``),
  as vLLM and SGLang compile it.

Reported per row: compile seconds, tokens walked, the median ms a token over the first, middle
and last ``--window`` tokens (the median: this is often a shared machine), and the worst token.
Each row runs in its own process under ``--budget`` seconds: a compile or walk that runs past it
is reported as far as it got ("timeout").

    .venv/bin/python bench/grammar_cost.py                  # every case (about half an hour)
    .venv/bin/python bench/grammar_cost.py -k enum regex    # cases whose name holds a word

Prints a table and writes JSON to bench/results/grammar_cost.json. No pass / fail: the numbers
are what ``engine/grammar_limits.py``'s limits and ``engine/grammar_rewrites.py``'s rewrites
were chosen from (ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("ferry", "xgrammar")
INT = {"type": "integer"}


@dataclass(frozen=True)
class Case:
    name: str
    spec: dict[str, Any]  # StructuredOutputsParams keyword arguments
    text: Callable[[], str]  # a valid output (walked as far as --max-tokens)


def _json(name: str, schema: Any, value: Any) -> Case:
    # Compact JSON as xgrammar writes it without optional whitespace: ", " and ": ".
    return Case(name, {"json": schema, "disable_any_whitespace": True}, lambda: json.dumps(value))


def _words(n: int, fmt: str = "w{:05d}") -> list[str]:
    return [fmt.format(i) for i in range(n)]


def _cases() -> list[Case]:
    long_ids = _words(4000, "item-" + "0" * 20 + "-{:05d}")
    optional = {f"p{i}": INT for i in range(100)}
    return [
        _json("json object", {"type": "object", "properties": {"a": INT, "b": {"type": "string"}}}, {"a": 1, "b": "x" * 400}),
        _json("json string maxLength 16", {"type": "string", "maxLength": 16}, "ab c" * 4),
        _json("json string maxLength 128", {"type": "string", "maxLength": 128}, "ab c" * 32),
        _json("json string minLength 5000", {"type": "string", "minLength": 5000}, "ab c" * 1250),
        _json("json string maxLength 100000", {"type": "string", "maxLength": 100000}, "ab c" * 1500),
        _json("json array minItems 10000", {"type": "array", "items": INT, "minItems": 10000}, list(range(10000))),
        _json("json array maxItems 10000", {"type": "array", "items": INT, "maxItems": 10000}, list(range(3000))),
        _json("json array minItems 200 objects",
              {"type": "array", "minItems": 200, "items": {"type": "object", "properties": {"x": INT}, "required": ["x"]}},
              [{"x": i} for i in range(300)]),
        _json("json enum 1000", {"enum": _words(1000)}, "w00999"),
        _json("json enum 20000 x 6 chars", {"enum": _words(20000)}, "w19999"),
        _json("json enum 4000 x 31 chars", {"enum": long_ids}, long_ids[-1]),
        _json("json anyOf 20000 consts", {"anyOf": [{"const": w} for w in _words(20000)]}, "w19999"),
        _json("json oneOf 2000 consts", {"oneOf": [{"const": w} for w in _words(2000)]}, "w01999"),
        _json("json anyOf 500 objects",
              {"anyOf": [{"type": "object", "properties": {f"k{i}": INT}, "required": [f"k{i}"]} for i in range(500)]},
              {"k499": 1}),
        _json("json const 10000 chars", {"const": "ab c" * 2500}, "ab c" * 2500),
        _json("json pattern [a-z]{5000}", {"type": "string", "pattern": "^[a-z]{5000}$"}, "abcd" * 1250),
        _json("json pattern [a-z]{250}", {"type": "string", "pattern": "^[a-z]{250}$"}, "abcd" * 62 + "ab"),
        _json("json pattern .{0,1000}", {"type": "string", "pattern": "^.{0,1000}$"}, "ab c" * 250),
        _json("json pattern [a-z]{0,128}", {"type": "string", "pattern": "^[a-z]{0,128}$"}, "abcd" * 32),
        # Patterns whose values hold characters JSON escapes (grammar_pattern_json: escapes written).
        _json("json pattern escapes .{0,128}", {"type": "string", "pattern": "^.{0,128}$"}, 'a"b\\c\x01' * 20),
        _json("json pattern escapes [^,]+", {"type": "string", "pattern": "^[^,]+$"}, 'say "hi"\tok\\' * 40),
        _json("json 64 optional properties", {"type": "object", "properties": dict(list(optional.items())[:64])},
              {f"p{i}": i for i in range(0, 64, 3)}),
        _json("json 100 optional properties", {"type": "object", "properties": optional}, {f"p{i}": i for i in range(0, 100, 3)}),
        _json("json 300 required properties",
              {"type": "object", "properties": {f"p{i}": INT for i in range(300)}, "required": [f"p{i}" for i in range(300)]},
              {f"p{i}": i for i in range(300)}),
        _json("json integer range 1e15", {"type": "integer", "minimum": -(10**15), "maximum": 10**15}, 123456789012345),
        _json("json number range", {"type": "number", "minimum": -1.5e10, "maximum": 3.25e12}, 1234567.125),
        _json("json prefixItems 500", {"type": "array", "prefixItems": [INT] * 500, "items": False}, list(range(500))),
        _json("json nested arrays 60 deep", {}, json.loads("[" * 60 + "1" + "]" * 60)),
        Case("json_object 200 deep", {"json_object": True}, lambda: '{"a":' * 200 + "1" + "}" * 200),
        Case("regex (\\w+\\s?)+", {"regex": "(\\w+\\s?)+"}, lambda: "ab c " * 400),
        Case("regex ([A-Z][a-z]* ?)+\\.", {"regex": "([A-Z][a-z]* ?)+\\."}, lambda: "The Quick Brown Fox " * 50 + "."),
        Case("regex (\\w|\\s){1,128}", {"regex": "(\\w|\\s){1,128}"}, lambda: "ab c" * 32),
        Case("regex (\\w+\\s?){1,20}", {"regex": "(\\w+\\s?){1,20}"}, lambda: "ab c " * 10),
        Case("regex .{0,500}", {"regex": ".{0,500}"}, lambda: "ab c" * 125),
        Case("regex [^x]{0,128}", {"regex": "[^x]{0,128}"}, lambda: "ab c" * 32),
        Case("regex [a-z]{1,50000}", {"regex": "[a-z]{1,50000}"}, lambda: "abcd" * 1000),
        Case("regex email", {"regex": "[\\w.+-]+@[\\w-]+\\.[\\w.-]+"}, lambda: "john.smith.the.third@mail.example.co.uk"),
        Case("regex a{10000}", {"regex": "a{10000}"}, lambda: "a" * 10000),
        Case("choice 1000", {"choice": _words(1000)}, lambda: "w00999"),
        Case("choice 20000 x 6 chars", {"choice": _words(20000)}, lambda: "w19999"),
        Case("grammar [a-z]{5000}", {"grammar": "root ::= [a-z]{5000}"}, lambda: "abcd" * 1250),
        Case("grammar [^x]{0,1000}", {"grammar": "root ::= [^x]{0,1000}"}, lambda: "ab c" * 250),
        Case("grammar ambiguous root root", {"grammar": 'root ::= root root | "a"'}, lambda: "a" * 400),
        Case("grammar right recursion", {"grammar": 'root ::= "a" root | "a"'}, lambda: "a" * 3000),
        Case(
            "structural_tag 200 tools",
            {
                "structural_tag": {
                    "structures": [
                        {"begin": f"<function=f{i}>", "schema": {"type": "object", "properties": {"a": INT}}, "end": "</function>"}
                        for i in range(200)
                    ],
                    "triggers": ["<function="],
                }
            },
            lambda: "hello " * 100 + '<function=f199>{"a": 1}</function>' + " bye" * 100,
        ),
    ]  # fmt: skip


def _tokenizer_dir(vocab_size: int) -> Path:
    base = Path(os.environ.get("FERRY_CACHE_DIR") or Path.home() / ".cache" / "ferry")
    target = base / f"grammar-cost-bpe-{vocab_size}"
    if not (target / "tokenizer.json").exists():
        from engine.demo import build_model

        build_model(target, tokenizer_vocab_size=vocab_size)
    return target


def _xgrammar_compile(compiler: Any, spec: Any) -> Any:
    """The constraint compiled by xgrammar alone, as vLLM compiles it."""
    from engine.structured_output import choice_grammar

    kind, any_ws = spec.kind, not spec.disable_any_whitespace
    if kind == "json":
        return compiler.compile_json_schema(spec.json, any_whitespace=any_ws)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_ws)
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(spec.choice))
    if kind == "grammar":
        return compiler.compile_grammar(spec.grammar)
    import xgrammar as xgr

    tag = json.loads(spec.structural_tag)
    items = [
        xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
        for s in tag["structures"]
    ]
    return compiler.compile_structural_tag(items, tag["triggers"])


def _run(name: str, mode: str, model_dir: str, max_tokens: int, out: Any) -> None:
    """In a child process: compile case ``name`` as ``mode`` does, then walk its output, sending
    results to ``out`` as they come (a case holds lambdas: the child builds the cases again)."""
    import torch
    import xgrammar as xgr

    from engine.sampling_params import StructuredOutputsParams
    from engine.structured_output import GrammarCompiler
    from engine.tokenizer import Tokenizer

    torch.set_num_threads(1)
    case = next(c for c in _cases() if c.name == name)
    tokenizer = Tokenizer.from_dir(model_dir)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    compiler.compile(StructuredOutputsParams(regex="a"))  # the vocabulary table, not timed
    spec = StructuredOutputsParams(**case.spec)
    t0 = time.perf_counter()
    try:
        compiled = (
            compiler.compile(spec) if mode == "ferry" else _xgrammar_compile(compiler._xgr_compiler(), spec)
        )
    except ValueError as e:
        out.put({"refused": str(e), "compile_s": time.perf_counter() - t0})
        return
    out.put({"compile_s": time.perf_counter() - t0})
    ids = tokenizer.backend.encode(case.text(), add_special_tokens=False).ids[:max_tokens]
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, tokenizer.vocab_size)
    times: list[float] = []
    for i, token in enumerate(ids):
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        ok = matcher.accept_token(token)
        times.append(time.perf_counter() - t)
        if not ok:
            out.put({"times": times, "rejected_at": i})
            return
        if len(times) == 20:
            out.put({"times": times})
            times = []
    out.put({"times": times, "done": True})


def measure(
    case: Case, mode: str, model_dir: str, window: int, max_tokens: int, budget: float
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_run, args=(case.name, mode, model_dir, max_tokens, results), daemon=True)
    start = time.perf_counter()
    proc.start()
    row: dict[str, Any] = {"case": case.name, "mode": mode, "status": "timeout"}
    times: list[float] = []
    while True:
        try:
            msg = results.get(timeout=max(budget - (time.perf_counter() - start), 0.01))
        except queue.Empty:
            if not proc.is_alive():
                row["status"] = f"died ({proc.exitcode})"
            break
        times += msg.pop("times", [])
        if "refused" in msg:
            row.update(msg, status="refused")
            break
        if "rejected_at" in msg:
            row["status"] = f"rejected at {msg['rejected_at']}"  # the case's text is wrong
            break
        if msg.pop("done", False):
            row["status"] = "ok"
            break
        row.update(msg)
    if proc.is_alive():
        proc.kill()
    proc.join()
    ms = [t * 1000 for t in times]
    row["tokens"] = len(ms)
    if ms:
        mid = len(ms) // 2
        row["first_ms"] = statistics.median(ms[:window])
        row["mid_ms"] = statistics.median(ms[max(0, mid - window // 2) : mid + window // 2 + 1])
        row["last_ms"] = statistics.median(ms[-window:])
        row["max_ms"] = max(ms)
        row["walk_s"] = sum(ms) / 1000
    return row


def _fmt(value: Any, spec: str, width: int) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-".rjust(width)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", nargs="*", default=[], help="run only cases whose name holds one of these")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument(
        "--vocab-size", type=int, default=32000, help="the demo BPE tokenizer's vocabulary (asked)"
    )
    ap.add_argument("--window", type=int, default=50, help="tokens in each median")
    ap.add_argument("--max-tokens", type=int, default=2000, help="tokens walked at most per row")
    ap.add_argument("--budget", type=float, default=30.0, help="seconds per row (compile + walk)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar_cost.json"))
    args = ap.parse_args(argv)

    model_dir = _tokenizer_dir(args.vocab_size)
    vocab = len(json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"])
    cases = [c for c in _cases() if not args.k or any(k in c.name for k in args.k)]
    print(f"vocabulary: {vocab} tokens; medians of {args.window} tokens; {args.budget:.0f} s a row at most")
    header = (
        f"{'case':34} {'mode':8} {'status':12} {'compile_s':>9} {'tokens':>6} "
        f"{'first_ms':>8} {'mid_ms':>8} {'last_ms':>8} {'max_ms':>8}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for case in cases:
        for mode in args.modes:
            r = measure(case, mode, str(model_dir), args.window, args.max_tokens, args.budget)
            rows.append(r)
            print(
                f"{case.name[:34]:34} {mode:8} {r['status'][:12]:12} {_fmt(r.get('compile_s'), '9.3f', 9)} "
                f"{r['tokens']:6d} {_fmt(r.get('first_ms'), '8.3f', 8)} {_fmt(r.get('mid_ms'), '8.3f', 8)} "
                f"{_fmt(r.get('last_ms'), '8.3f', 8)} {_fmt(r.get('max_ms'), '8.2f', 8)}",
                flush=True,
            )
            if r["status"] == "refused":
                print(f"    400: {r['refused'][:150]}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "vocab_size": vocab,
        "window": args.window,
    }
    out.write_text(json.dumps({**meta, "budget_s": args.budget, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
