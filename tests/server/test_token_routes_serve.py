"""vLLM's token-level routes on the shared replica over tiny_llama (ChatML template):
``/v1/chat/completions/render`` and ``/v1/completions/render`` answer the token ids a real request
runs with (checked against the prompt ids the real request reports through ``prompt_logprobs``
and ``usage.prompt_tokens``), and ``/inference/v1/generate`` generates from token ids what the
same greedy request through ``/v1/completions`` generates; bad bodies are 400s in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _real_prompt_ids(answer: dict, first: int) -> list[int]:
    """The prompt ids a real request ran with: its ``prompt_logprobs`` (asked with 0 alternatives,
    each position holds only the prompt's token) after the first, which has no logprob."""
    entries = answer.get("prompt_logprobs") or answer["choices"][0]["prompt_logprobs"]
    assert entries[0] is None
    ids = [first]
    for entry in entries[1:]:
        assert len(entry) == 1
        ids.append(int(next(iter(entry))))
    assert answer["usage"]["prompt_tokens"] == len(ids)
    return ids


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": TOOLS, "tool_choice": "required"},
        {"add_generation_prompt": False},
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "Bl"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        {"truncate_prompt_tokens": 5},
    ],
    ids=["plain", "tools", "no_generation_prompt", "continue_final_message", "truncated"],
)
def test_chat_render_is_what_a_real_request_runs(server, extra: dict) -> None:
    body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, **extra}
    r = _post(server, "/v1/chat/completions/render", body)
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert rendered["request_id"].startswith("chatcmpl-")
    assert rendered["features"] is None and rendered["stream"] is False
    ids = rendered["token_ids"]
    assert rendered["sampling_params"]["max_tokens"] == 3
    assert rendered["sampling_params"]["temperature"] == 0.0
    real = _post(server, "/v1/chat/completions", {**body, "prompt_logprobs": 0})
    assert real.status_code == 200, real.text
    assert _real_prompt_ids(real.json(), ids[0]) == ids
    tokenized = _post(server, "/tokenize", {k: v for k, v in body.items() if k != "max_tokens"})
    if "truncate_prompt_tokens" not in extra:  # /tokenize does not truncate
        assert tokenized.json()["tokens"] == ids
    else:
        assert len(ids) == 5 and tokenized.json()["tokens"][-5:] == ids


def test_chat_render_shows_the_template_and_tools(server) -> None:
    plain = _post(server, "/v1/chat/completions/render", {"messages": MESSAGES}).json()
    text = _post(server, "/detokenize", {"tokens": plain["token_ids"]}).json()["prompt"]
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # No max_tokens: the rest of the context, as the real request's budget.
    assert plain["sampling_params"]["max_tokens"] == 1024 - len(plain["token_ids"])
    cont = _post(
        server,
        "/v1/chat/completions/render",
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "Bl"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ).json()
    shown = _post(server, "/detokenize", {"tokens": cont["token_ids"]}).json()["prompt"]
    assert shown.endswith("<|im_start|>assistant\nBl")


@pytest.mark.parametrize(
    "prompt",
    ["The quick brown fox", [1, 2, 3, 4, 5, 6, 7]],
    ids=["text", "tokens"],
)
def test_completion_render_is_what_a_real_request_runs(server, tokenizer, prompt) -> None:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = _post(server, "/v1/completions/render", body)
    assert r.status_code == 200, r.text
    [rendered] = r.json()
    assert rendered["request_id"].startswith("cmpl-")
    ids = rendered["token_ids"]
    expected = prompt if isinstance(prompt, list) else tokenizer.encode(prompt)
    assert ids == expected
    real = _post(server, "/v1/completions", {**body, "prompt_logprobs": 0}).json()
    assert _real_prompt_ids(real, ids[0]) == ids


def test_completion_render_of_several_prompts_truncated(server, tokenizer) -> None:
    body = {"prompt": ["one two three four five six", "seven"], "truncate_prompt_tokens": 3, "n": 2}
    rendered = _post(server, "/v1/completions/render", body).json()
    assert [r["token_ids"] for r in rendered] == [
        tokenizer.encode("one two three four five six")[-3:],
        tokenizer.encode("seven")[-3:],
    ]
    assert [r["sampling_params"]["n"] for r in rendered] == [2, 2]
    assert [r["sampling_params"]["max_tokens"] for r in rendered] == [16, 16]


def test_render_refuses_what_a_real_request_refuses(server) -> None:
    too_long = {"prompt": [5] * 1030, "max_tokens": 1}
    for path, body in (
        ("/v1/completions/render", too_long),
        ("/v1/completions/render", {"prompt": [10**9]}),
        ("/v1/chat/completions/render", {"messages": MESSAGES, "max_tokens": 5000}),
        ("/v1/chat/completions/render", {"messages": []}),
    ):
        r = _post(server, path, body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["type"] == "BadRequestError"
    r = _post(server, "/v1/completions/render", {"prompt": "x", "model": "nope"})
    assert r.status_code == 404


def test_generate_equals_the_greedy_completion(server) -> None:
    rendered = _post(server, "/v1/completions/render", {"prompt": "The quick brown fox", "max_tokens": 6})
    [req] = rendered.json()
    req["sampling_params"]["temperature"] = 0
    r = _post(server, "/inference/v1/generate", req)
    assert r.status_code == 200, r.text
    out = r.json()
    real = _post(
        server,
        "/v1/completions",
        {"prompt": req["token_ids"], "max_tokens": 6, "temperature": 0, "return_token_ids": True},
    ).json()
    assert out["choices"][0]["token_ids"] == real["choices"][0]["token_ids"]
    assert out["choices"][0]["finish_reason"] == real["choices"][0]["finish_reason"]
    assert out["usage"] == real["usage"]
    assert out["request_id"] == out["id"] == "generate-tokens-" + req["request_id"]
    # The X-Request-Id header names the answer over the body's request_id, as in vLLM.
    named = httpx.post(
        server.url + "/inference/v1/generate", json=req, headers={"X-Request-Id": "mine-1"}, timeout=60
    )
    assert named.json()["request_id"] == "generate-tokens-mine-1"
    assert named.json()["choices"] == out["choices"]
    assert out["choices"][0]["logprobs"] is None


def test_generate_resumes_after_tokens_sent_elsewhere(server) -> None:
    """ferry's ``resume`` on generate (what a router sends when a stream's replica died): the answer
    goes on after the given tokens exactly as the uninterrupted greedy run did, its budget counting
    them, whole or streamed; a resume of unknown shape is a 400."""
    [req] = _post(server, "/v1/completions/render", {"prompt": "The quick brown fox", "max_tokens": 8}).json()
    req["sampling_params"]["temperature"] = 0
    full = _post(server, "/inference/v1/generate", req).json()["choices"][0]["token_ids"]
    assert len(full) == 8
    resumed = {**req, "resume": {"token_ids": full[:3]}}
    whole = _post(server, "/inference/v1/generate", resumed).json()
    assert whole["choices"][0]["token_ids"] == full[3:]
    assert whole["usage"]["completion_tokens"] == 5
    with httpx.stream(
        "POST", server.url + "/inference/v1/generate", json={**resumed, "stream": True}, timeout=60
    ) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert [t for d in data[:-1] for c in json.loads(d)["choices"] for t in c["token_ids"]] == full[3:]
    bad = _post(server, "/inference/v1/generate", {**req, "resume": {"token_ids": []}})
    assert bad.status_code == 400, bad.text


def test_generate_logprobs_stream_and_chat_render(server) -> None:
    chat = _post(server, "/v1/chat/completions/render", {"messages": MESSAGES, "max_tokens": 5}).json()
    chat["sampling_params"].update(temperature=0, logprobs=2)
    whole = _post(server, "/inference/v1/generate", chat).json()
    real = _post(
        server,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True},
    ).json()
    choice = whole["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert [c["logprob"] for c in content] == pytest.approx(
        [c["logprob"] for c in real["choices"][0]["logprobs"]["content"]]
    )
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert whole["usage"]["prompt_tokens"] == len(chat["token_ids"])

    chat["stream"] = True
    chat["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + "/inference/v1/generate", json=chat, timeout=60) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert streamed == choice["token_ids"]
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1] == choice["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": [], "sampling_params": {}}, "token_ids"),
        ({"token_ids": ["a"], "sampling_params": {}}, "token_ids.0"),
        ({"token_ids": [1, 10**9], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [5] * 1024, "sampling_params": {}}, "prompt"),
        ({"token_ids": [5] * 1000, "sampling_params": {"max_tokens": 100}}, "max_tokens"),
        ({"token_ids": [1, 2], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"token_ids": [1, 2], "sampling_params": {"top_p": "x"}}, "sampling_params.top_p"),
        ({"token_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
        ({"token_ids": [1, 2], "sampling_params": {"logprobs": 10**6}}, "sampling_params.logprobs"),
        ({"token_ids": [1, 2], "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate"),
        ({"token_ids": [1, 2]}, "sampling_params"),
        ({"token_ids": [1, 2], "sampling_params": {}, "features": {"mm_hashes": {}}}, "features"),
        # a top-level field's 400 names it, not sampling_params.priority
        ({"token_ids": [1, 2], "sampling_params": {}, "priority": 2**80}, "priority"),
    ],
)
def test_generate_refuses_bad_bodies_with_400(server, body: dict, param: str) -> None:
    r = _post(server, "/inference/v1/generate", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["param"] == param, error


@pytest.mark.parametrize("stream", [False, True])
def test_generate_refuses_a_constraint_that_does_not_compile(server, stream: bool) -> None:
    """As completions: a 400 naming the field before a stream starts, not an error event in a 200."""
    params = {"max_tokens": 3, "structured_outputs": {"regex": "("}}
    body = {"token_ids": [1, 2], "stream": stream, "sampling_params": params}
    r = _post(server, "/inference/v1/generate", body)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["param"] == "sampling_params.structured_outputs"
    assert "regex" in r.json()["error"]["message"]


def test_generate_without_max_tokens_runs_to_the_end_of_the_context(server) -> None:
    """No ``sampling_params.max_tokens``: the rest of the context is the budget (vLLM's
    ``get_max_tokens`` for a generate that leaves it out), not the completions default of 16, and a
    prompt with fewer than 16 tokens of room left is run, not refused."""
    params = {"temperature": 0, "ignore_eos": True}
    for prompt_len in (1000, 1010):
        r = _post(
            server, "/inference/v1/generate", {"token_ids": [5] * prompt_len, "sampling_params": params}
        )
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert len(choice["token_ids"]) == 1024 - prompt_len and choice["finish_reason"] == "length"
        assert r.json()["usage"]["total_tokens"] == 1024


def test_a_rendered_constraint_and_n_go_back_through_generate(server) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 8, "n": 2}
    rendered = _post(server, "/v1/chat/completions/render", body).json()
    constraint = rendered["sampling_params"]["structured_outputs"]
    assert constraint is not None and list(constraint) != []
    assert rendered["sampling_params"]["n"] == 2
    rendered["sampling_params"].update(temperature=0)
    out = _post(server, "/inference/v1/generate", rendered)
    assert out.status_code == 200, out.text
    choices = out.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["token_ids"] == choices[1]["token_ids"]  # greedy: both the same
    assert out.json()["usage"]["completion_tokens"] == 2 * len(choices[0]["token_ids"])


def _aborted(server, scrape) -> float:
    name = server.model_name
    return scrape(server.url, "vllm:request_success_total", model_name=name, finished_reason="abort") or 0


def _wait_idle(server, scrape, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    name = server.model_name
    while scrape(server.url, "vllm:num_requests_running", model_name=name) or scrape(
        server.url, "vllm:kv_cache_usage_perc", model_name=name
    ):
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.02)


LONG = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1000, "ignore_eos": True}}


def test_a_disconnected_generate_stream_is_aborted(server, scrape) -> None:
    before = _aborted(server, scrape)
    with httpx.stream(
        "POST", server.url + "/inference/v1/generate", json={**LONG, "stream": True}, timeout=30
    ) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(lines).startswith("data: ")
        deadline = time.monotonic() + 60
        while scrape(server.url, "vllm:num_requests_running", model_name=server.model_name) != 1:
            assert time.monotonic() < deadline, "request never started running"
            time.sleep(0.02)
    _wait_idle(server, scrape)
    assert _aborted(server, scrape) == before + 1


async def test_a_disconnected_whole_generate_is_aborted(server, scrape) -> None:
    before = _aborted(server, scrape)
    async with httpx.AsyncClient(timeout=30) as client:
        task = asyncio.ensure_future(client.post(server.url + "/inference/v1/generate", json=LONG))
        deadline = time.monotonic() + 60
        while scrape(server.url, "vllm:num_requests_running", model_name=server.model_name) != 1:
            assert time.monotonic() < deadline, "request never started running"
            await asyncio.sleep(0.02)
        task.cancel()  # closes the connection
        with pytest.raises(asyncio.CancelledError):
            await task
    _wait_idle(server, scrape)
    assert _aborted(server, scrape) == before + 1


def _spans(text: str, offsets: list[list[int]]) -> list[str]:
    return [text[start:end] for start, end in offsets]


def test_render_token_offsets(server, tokenizer) -> None:
    """vLLM's ``return_token_offsets``: each prompt token's character span in its source (the prompt
    string, or the text the chat template rendered), read back as that token's own text; a truncated
    prompt's are its tokens' spans, a token-id prompt has none, generation routes ignore the field."""
    text = "def área(x):\n    return x  # naïve"
    body = {"prompt": [text, "seven eight nine"], "return_token_offsets": True}
    rendered = _post(server, "/v1/completions/render", body).json()
    ids, offsets = rendered[0]["token_ids"], rendered[0]["token_offsets"]
    assert len(offsets) == len(ids) == len(tokenizer.encode(text))
    # A token's span is its own text; the byte tokens of one character ("á" here) each span it whole.
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "\ufffd" in pieces
    for piece, span in zip(pieces, _spans(text, offsets), strict=True):
        assert span == piece or (piece == "\ufffd" and span in "áï")
    assert "".join(text[s:e] for s, e in dict.fromkeys(map(tuple, offsets))) == text
    assert "".join(_spans("seven eight nine", rendered[1]["token_offsets"])) == "seven eight nine"
    tokens = _post(server, "/v1/completions/render", {"prompt": [5, 6, 7], "return_token_offsets": True})
    assert tokens.json()[0]["token_offsets"] is None
    cut = _post(server, "/v1/completions/render", {**body, "truncate_prompt_tokens": 4}).json()
    assert cut[0]["token_offsets"] == offsets[-4:]
    right = {**body, "truncate_prompt_tokens": 4, "truncation_side": "right"}
    assert _post(server, "/v1/completions/render", right).json()[0]["token_offsets"] == offsets[:4]
    assert "token_offsets" not in _post(server, "/v1/completions/render", {"prompt": text}).json()[0]

    chat = {"messages": MESSAGES, "max_tokens": 1}
    templated = _post(server, "/v1/chat/completions", {**chat, "return_prompt_text": True}).json()[
        "prompt_text"
    ]
    got = _post(server, "/v1/chat/completions/render", {**chat, "return_token_offsets": True}).json()
    assert _spans(templated, got["token_offsets"]) == [
        tokenizer.decode([t], skip_special_tokens=False) for t in got["token_ids"]
    ]
    assert "".join(_spans(templated, got["token_offsets"])) == templated
    answer = _post(server, "/v1/completions", {"prompt": text, "max_tokens": 1, "return_token_offsets": True})
    assert answer.status_code == 200 and "token_offsets" not in answer.json()
