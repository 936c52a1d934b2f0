"""A request with many ``bad_words`` is answered as one with a few, instead of holding the API
server's event loop (and every other request on it) for minutes: its words' token sequences were
deduplicated through a list, quadratic in their number (60k words: minutes; now about a second)."""

from __future__ import annotations

import httpx

from server.params import bad_words_token_ids

WORDS = 60_000


def test_many_bad_words_are_answered(server) -> None:  # noqa: ANN001 - conftest's ServerProcess
    words = [f"w{i}" for i in range(WORDS)]
    body = {
        "model": server.model_name,
        "prompt": "hello",
        "max_tokens": 2,
        "ignore_eos": True,
        "bad_words": words,
    }
    # The timeout is the test's bound: generous for a loaded box, far below the quadratic minutes.
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=90)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["finish_reason"], r.json()["usage"]["completion_tokens"]) == ("length", 2)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_bad_word_sequences_keep_their_order_without_repeats(tokenizer) -> None:  # noqa: ANN001
    words = ["cat", " cat", "dog", "cat"]
    seqs = bad_words_token_ids(words, tokenizer)
    expected: list[list[int]] = []
    for text in ("cat", " cat", "dog", " dog"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids not in expected:
            expected.append(ids)
    assert seqs == expected
