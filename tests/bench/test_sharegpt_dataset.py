"""`ferry bench --dataset sharegpt`: ShareGPT files written here, the exact request set a seed
selects (first human turn as prompt, the reply's token count as max_tokens, vLLM's length filters),
conversation replay with --turns, clear errors, and live runs against the stand-in and `ferry serve`.

The local tokenizer is a word-level one (one whitespace-separated word = one token), so every
expected length below is a word count."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest


def _text(start: int, n: int) -> str:
    """``n`` distinct words (so every prompt is recognisable): n tokens for the word tokenizer."""
    return " ".join(f"w{start + i}" for i in range(n))


def _turns(*spec: tuple[str, int]) -> list[dict]:
    return [{"from": role, "value": _text(100 * k, n)} for k, (role, n) in enumerate(spec)]


# Record index -> turns. Expected fates under --sharegpt-max-input-len 16 --sharegpt-max-total-len 18.
RECORDS = [
    _turns(("human", 6), ("gpt", 5)),  # 0 usable
    _turns(("human", 3), ("gpt", 10)),  # 1 prompt under 4 tokens
    _turns(("human", 8), ("gpt", 3)),  # 2 reply under 4 tokens (usable with --output-len)
    _turns(("gpt", 4), ("human", 5), ("gpt", 7)),  # 3 usable: the first *human* turn is the prompt
    _turns(("human", 20), ("gpt", 5)),  # 4 prompt over 16
    [],  # 5 no turns: no pair
    _turns(("system", 4), ("human", 7), ("gpt", 9), ("human", 4), ("gpt", 6)),  # 6 usable, 2 pairs
    _turns(("human", 10), ("gpt", 10)),  # 7 prompt + reply 20 over 18
    _turns(("human", 5), ("human", 5)),  # 8 no reply: no pair
]
LIMITS = "--sharegpt-max-input-len 16 --sharegpt-max-total-len 18"


def _prompt(i: int, pair: int = 0) -> str:
    humans = [t["value"] for t in RECORDS[i] if t["from"] == "human"]
    return humans[pair]


@pytest.fixture
def word_tokenizer(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(1000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = tmp_path / "wordtok"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture
def sharegpt_file(tmp_path: Path) -> Path:
    path = tmp_path / "sharegpt.json"
    records = [{"id": f"r{i}", "conversations": turns} for i, turns in enumerate(RECORDS)]
    path.write_text(json.dumps(records, indent=1))
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_seeded_selection_and_vllm_filters(standin, bench, word_tokenizer, sharegpt_file, tmp_path) -> None:
    srv = standin()
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    common = (
        f"--base-url {srv.url} --dataset sharegpt --tokenizer {word_tokenizer} --endpoint chat "
        f"--num-prompts 10 {LIMITS} --dry-run"
    )
    rc, out = bench(common + " --seed 7", "--dataset-path", str(sharegpt_file), "--output-dir", str(a))
    assert rc == 0, out
    # Usable records shuffled by seed 7: [6, 7, 4, 0, 3, 1, 2]; 7 and 4 too long, 1 and 2 too short.
    lines = _lines(a / "requests.jsonl")
    assert [x["messages"] for x in lines] == [[{"role": "user", "content": _prompt(i)}] for i in (6, 0, 3)]
    assert [x["max_tokens"] for x in lines] == [9, 5, 7]  # the replies' word counts
    assert [x["ferry_bench"] for x in lines] == [
        {"input_len": 7, "output_len": 9},
        {"input_len": 6, "output_len": 5},
        {"input_len": 5, "output_len": 7},
    ]
    assert all(x["stream"] and x["temperature"] == 0.0 for x in lines)
    assert f"note: {sharegpt_file} has 3 usable pairs, fewer than the 10 asked for" in out
    environment = json.loads((a / "environment.json").read_text())
    assert environment["flags"]["dataset"] == "sharegpt"

    assert bench(common + " --seed 7", "--dataset-path", str(sharegpt_file), "--output-dir", str(b))[0] == 0
    assert (a / "requests.jsonl").read_bytes() == (b / "requests.jsonl").read_bytes()
    assert bench(common + " --seed 1", "--dataset-path", str(sharegpt_file), "--output-dir", str(c))[0] == 0
    # Seed 1 shuffles to [3, 7, 6, 2, 0, 4, 1].
    assert [x["messages"][0]["content"] for x in _lines(c / "requests.jsonl")] == [
        _prompt(i) for i in (3, 6, 0)
    ]

    # --num-prompts stops the walk early; --warmup adds to it.
    d = tmp_path / "d"
    flags = common.replace("--num-prompts 10", "--num-prompts 1 --warmup 1") + " --seed 7"
    rc, out = bench(flags, "--dataset-path", str(sharegpt_file), "--output-dir", str(d))
    assert rc == 0 and "note:" not in out
    assert [x["messages"][0]["content"] for x in _lines(d / "requests.jsonl")] == [_prompt(6), _prompt(0)]


def test_output_len_overrides_replies_and_default_limits(
    standin, bench, word_tokenizer, sharegpt_file, tmp_path
) -> None:
    srv = standin()
    out = tmp_path / "fixed"
    flags = (
        f"--base-url {srv.url} --dataset sharegpt --tokenizer {word_tokenizer} --num-prompts 10 "
        f"{LIMITS} --output-len 2 --seed 7 --dry-run"
    )
    rc, stdout = bench(flags, "--dataset-path", str(sharegpt_file), "--output-dir", str(out))
    assert rc == 0, stdout
    lines = _lines(out / "requests.jsonl")
    # Completions; a fixed output of 2 skips the reply's own check (2 is back in) and makes 7 short
    # enough (10 + 2 <= 18); 4's prompt is still over 16 and 1's under 4.
    assert [x["prompt"] for x in lines] == [_prompt(i) for i in (6, 7, 0, 3, 2)]
    assert {x["max_tokens"] for x in lines} == {2}

    out = tmp_path / "defaults"
    flags = f"--base-url {srv.url} --dataset sharegpt --tokenizer {word_tokenizer} --seed 7 --dry-run"
    rc, stdout = bench(flags, "--dataset-path", str(sharegpt_file), "--output-dir", str(out))
    assert rc == 0, stdout
    # vLLM's limits (1024 / 2048): only the under-4 pairs go.
    assert [x["prompt"] for x in _lines(out / "requests.jsonl")] == [_prompt(i) for i in (6, 7, 4, 0, 3)]
    assert "fewer than the 1000 asked for" in stdout  # vLLM's default count


def test_json_lines_conversation_key_and_token_ids(standin, bench, word_tokenizer, tmp_path) -> None:
    srv = standin()
    path = tmp_path / "sharegpt.jsonl"
    records = [{"conversation": RECORDS[0]}, {"conversations": RECORDS[3]}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    out = tmp_path / "ids"
    flags = (
        f"--base-url {srv.url} --dataset sharegpt --tokenizer {word_tokenizer} --token-ids --seed 0 --dry-run"
    )
    rc, stdout = bench(flags, "--dataset-path", str(path), "--output-dir", str(out))
    assert rc == 0, stdout
    lines = _lines(out / "requests.jsonl")
    # Seed 0 keeps the order [0, 1]; word w<i> is id i + 1.
    assert [x["prompt"] for x in lines] == [[1, 2, 3, 4, 5, 6], [101, 102, 103, 104, 105]]
    assert [x["max_tokens"] for x in lines] == [5, 7]


def test_turns_replays_conversations(standin, bench, sharegpt_file, tmp_path: Path) -> None:
    """--turns 2: each record is a session of up to 2 human turns, sent after the previous answer with
    the conversation so far; the stand-in counts bytes, and with --tokenizer server so does the bench."""
    srv = standin("--tokens", "100000")
    out = tmp_path / "sessions"
    flags = f"--base-url {srv.url} --dataset sharegpt --turns 2 --tokenizer server --seed 7 --concurrency 2"
    rc, stdout = bench(flags, "--dataset-path", str(sharegpt_file), "--output-dir", str(out))
    assert rc == 0, stdout
    lines = _lines(out / "requests.jsonl")
    # Seed 7: [6, 7, 4, 0, 3, 1, 2]; byte lengths, so record 1's 3 words (11 bytes) pass too. Only
    # record 6 has a second pair.
    order = (6, 7, 4, 0, 3, 1, 2)
    sessions = [(x["ferry_bench"]["session_id"], x["ferry_bench"]["turn"]) for x in lines]
    expected = [("bench-7-s00000", 0), ("bench-7-s00000", 1)] + [
        (f"bench-7-s0000{k}", 0) for k in range(1, 7)
    ]
    assert sessions == expected
    contents = [x["messages"][0]["content"] for x in lines]
    assert contents == [_prompt(6), _prompt(6, 1)] + [_prompt(i) for i in order[1:]]
    reply = [t["value"] for t in RECORDS[6] if t["from"] == "gpt"]
    assert [lines[0]["max_tokens"], lines[1]["max_tokens"]] == [len(r.encode()) for r in reply]
    recs = [json.loads(x) for x in (out / "raw.jsonl").read_text().splitlines()]
    assert all(r["ok"] for r in recs)
    by_turn = {(r["session_id"], r["turn"]): r for r in recs}
    first, second = by_turn[("bench-7-s00000", 0)], by_turn[("bench-7-s00000", 1)]
    # Turn 2 resends turn 1 and the server's whole answer (max_tokens bytes) before its own message.
    assert first["prompt_tokens"] == len(_prompt(6).encode())
    assert second["prompt_tokens"] == first["prompt_tokens"] + first["completion_tokens"] + len(
        _prompt(6, 1).encode()
    )
    assert first["completion_tokens"] == len(reply[0].encode())
    stats = httpx.get(srv.url + "/standin/stats").json()
    assert stats["sessions"]["bench-7-s00000"] == 2


def test_turns_count_the_context_into_the_limits(
    standin, bench, word_tokenizer, sharegpt_file, tmp_path
) -> None:
    """Record 6's second human turn (4 tokens) follows 7 + 9 tokens of context: 20 > 16, so its
    session ends after one turn under LIMITS and keeps both under vLLM's defaults."""
    srv = standin()
    flags = (
        f"--base-url {srv.url} --dataset sharegpt --tokenizer {word_tokenizer} --turns 2 --seed 7 --dry-run"
    )
    tight, loose = tmp_path / "tight", tmp_path / "loose"
    assert (
        bench(flags + " " + LIMITS, "--dataset-path", str(sharegpt_file), "--output-dir", str(tight))[0] == 0
    )
    assert bench(flags, "--dataset-path", str(sharegpt_file), "--output-dir", str(loose))[0] == 0
    tight_lines, loose_lines = _lines(tight / "requests.jsonl"), _lines(loose / "requests.jsonl")
    assert [x["messages"][0]["content"] for x in tight_lines] == [_prompt(i) for i in (6, 0, 3)]
    assert [x["ferry_bench"]["turn"] for x in tight_lines] == [0, 0, 0]
    assert [x["messages"][0]["content"] for x in loose_lines[:2]] == [_prompt(6), _prompt(6, 1)]
    assert loose_lines[1]["ferry_bench"] == {
        "session_id": "bench-7-s00000",
        "turn": 1,
        "input_len": 4,
        "output_len": 6,
    }


def test_live_completions_on_the_standin_count_tokens_exactly(
    standin, bench, sharegpt_file, tmp_path
) -> None:
    srv = standin("--tokens", "100000")
    out = tmp_path / "live"
    flags = f"--base-url {srv.url} --dataset sharegpt --tokenizer server --num-prompts 3 --warmup 1"
    rc, stdout = bench(flags, "--dataset-path", str(sharegpt_file), "--output-dir", str(out))
    assert rc == 0, stdout
    recs = [json.loads(x) for x in (out / "raw.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and sum(r["warmup"] for r in recs) == 1
    for r in recs:  # the server's /tokenize measured the prompt and the reply: exact
        assert r["ok"] and r["prompt_tokens"] == r["input_len"] and r["completion_tokens"] == r["output_len"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"]["name"] == "sharegpt" and summary["dataset"]["requests"] == 4
    assert summary["dataset"]["token_source"] == {"kind": "server", "url": srv.url}


def test_live_on_ferry_serve(ferry_serve, tiny_llama: Path, bench, sharegpt_file, tmp_path) -> None:
    out = tmp_path / "serve"
    flags = (
        f"--base-url {ferry_serve.url} --dataset sharegpt --tokenizer {tiny_llama} --endpoint completions "
        "--ignore-eos --num-prompts 3 --concurrency 2 --seed 7"
    )
    rc, stdout = bench(flags, "--dataset-path", str(sharegpt_file), "--output-dir", str(out))
    assert rc == 0, stdout
    recs = [json.loads(x) for x in (out / "raw.jsonl").read_text().splitlines()]
    assert len(recs) == 3
    for r in recs:  # the model's own tokenizer counted the prompt; ignore_eos runs to max_tokens
        assert r["ok"], r
        assert r["prompt_tokens"] == r["input_len"] and r["completion_tokens"] == r["output_len"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('[{"conversations": []}, {"conversations": [{"from": "human"}]}]',
         'record [1]: turn 0: expected {"from": ROLE, "value": TEXT}, got {"from": "human"}'),
        ('[{"conversations": []}, ["human", "hi"]]',
         "record [1]: a record must be a JSON object with a 'conversations' list"),
        ('[{"id": "x", "messages": []}]',
         "record [0]: no 'conversations' list of {\"from\": ROLE, \"value\": TEXT} turns"),
        ('[\n{"conversations": []},\n{"conversations": [}\n]', ":3: not JSON: Expecting value"),
        ('{"conversations": []}\n{"conversations": []}\n{oops\n', ":3: not JSON: "),
    ],
)  # fmt: skip
def test_malformed_files_name_the_record(standin, bench, tmp_path: Path, content: str, message: str) -> None:
    srv = standin()
    path = tmp_path / "bad.json"
    path.write_text(content)
    rc, out = bench(
        f"--base-url {srv.url} --dataset sharegpt --tokenizer words --dry-run", "--dataset-path", str(path)
    )
    assert rc == 2
    assert out.strip().splitlines()[-1].startswith(f"ferry bench: error: {path}")
    assert message in out


def test_unusable_files_and_flags_are_clear(standin, bench, word_tokenizer, tmp_path: Path) -> None:
    srv = standin()
    base = f"--base-url {srv.url} --dataset sharegpt --tokenizer {word_tokenizer} --dry-run"
    missing = tmp_path / "nope.json"
    rc, out = bench(base, "--dataset-path", str(missing))
    assert rc == 2 and out.strip() == f"ferry bench: error: --dataset-path {missing}: no such file"

    path = tmp_path / "unusable.json"
    path.write_text(json.dumps([{"conversations": RECORDS[i]} for i in (1, 2, 4, 5, 8)]))
    rc, out = bench(base + " --sharegpt-max-input-len 16", "--dataset-path", str(path))
    assert rc == 2
    assert out.strip() == (
        f"ferry bench: error: {path}: no usable prompt/reply pair among 5 records: 2 without a human "
        "turn followed by a reply, 2 under 4 tokens, 1 over --sharegpt-max-input-len 16 or "
        "--sharegpt-max-total-len 2048 tokens"
    )

    rc, out = bench("--dataset sharegpt")
    assert rc == 2 and "--dataset sharegpt needs --dataset-path FILE" in out
    rc, out = bench("--dataset sharegpt --dataset-path x.json --turns 3 --endpoint completions")
    assert rc == 2 and "--dataset sharegpt --turns needs --endpoint chat" in out
    rc, out = bench("--dataset sharegpt --dataset-path x.json --sharegpt-max-total-len 0")
    assert rc == 2 and "--sharegpt-max-total-len must be >= 1" in out
