"""The OpenAI API of one replica, driven by the official openai SDK against a live `ferry serve`.

Greedy results through HTTP are compared token for token with the offline ``LLM`` on the same
checkpoint (token ids come back through ``return_tokens_as_token_ids`` logprobs).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from kvcache.keys import block_hashes, to_hex

PROMPT = "def parse_args(argv):\n    parser = "
LONG_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n        print(name)\n"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


@pytest.fixture
def aclient(server) -> openai.AsyncOpenAI:
    # One per test: the async client binds its connection pool to the test's event loop.
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), num_kv_blocks=256, num_threads=1)


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def offline(llm: LLM, prompt: str | list[int], **params) -> tuple[list[int], str, str]:
    out = llm.generate([prompt], SamplingParams(**params))[0].outputs[0]
    return list(out.token_ids), out.text, out.finish_reason


# ------------------------------------------------------------------ meta endpoints


def test_models_health_version(server, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_name]
    assert models.data[0].model_extra["max_model_len"] == 1024
    assert client.models.retrieve(server.model_name) == models.data[0]  # OpenAI's retrieve model
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/other-model")
    assert missing.value.body["code"] == "model_not_found"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_tokenize_detokenize_match_tokenizer(server, tokenizer) -> None:
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode(PROMPT)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPT}


# ------------------------------------------------------------------ completions


def test_completion_greedy_equals_offline_llm(client, llm) -> None:
    resp = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    ids, text, reason = offline(llm, PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    choice = resp.choices[0]
    assert ids_of(choice.logprobs.tokens) == ids
    assert choice.text == text and choice.finish_reason == reason == "length"
    assert resp.object == "text_completion"
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPT))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12


def test_completion_many_prompts_and_n(client, llm, tokenizer) -> None:
    prompts = [tokenizer.encode("class Foo:"), tokenizer.encode("return self.")]
    resp = client.completions.create(
        model=None, prompt=prompts, n=2, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        _, text, _ = offline(llm, prompt, max_tokens=6, temperature=0, ignore_eos=True)
        assert resp.choices[2 * i].text == resp.choices[2 * i + 1].text == text
    assert resp.usage.prompt_tokens == sum(len(p) for p in prompts)  # each prompt once, not once per choice
    assert resp.usage.completion_tokens == 4 * 6
    strings = client.completions.create(
        prompt=["class Foo:", "return self."],
        max_tokens=6,
        temperature=0,
        model=None,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in strings.choices] == [resp.choices[0].text, resp.choices[2].text]


def test_completion_stream_equals_non_stream(client) -> None:
    kwargs = dict(model=None, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_sse_framing_on_the_wire(server) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert all(p["choices"][0]["finish_reason"] is None for p in payloads[:-2])


def test_text_offsets_index_the_returned_text(client, tokenizer) -> None:
    # A lone byte of a multi-byte character (shown as "bytes:\\xcc", read as one U+FFFD) and a
    # skipped special token (shown as its text, absent from the text) move the offset by what
    # they add to the text, so every offset is where its token starts in ``text``.
    lone_byte = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size)).index("\u00cc")
    special = min(tokenizer.all_special_ids)
    prompt = tokenizer.encode("ab") + [lone_byte] + tokenizer.encode(" used it") + [special]
    prompt += tokenizer.encode(" here")
    answers = [
        client.completions.create(
            model=None,
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            echo=True,
            logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": as_ids},
        ).choices[0]
        for as_ids in (False, True)
    ]
    shown, by_id = answers
    ids = ids_of(by_id.logprobs.tokens)
    assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + 4
    assert shown.text == by_id.text == tokenizer.decode(ids)
    assert shown.logprobs.tokens[prompt.index(lone_byte)] == "bytes:\\xcc"
    assert shown.logprobs.tokens[prompt.index(special)] == tokenizer.decode(
        [special], skip_special_tokens=False
    )
    expected = [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    assert shown.logprobs.text_offset == by_id.logprobs.text_offset == expected


def test_echo_with_max_tokens_0_scores_the_prompt(client, tokenizer) -> None:
    # OpenAI's legacy idiom (and vLLM's) for scoring a prompt: its text and logprobs, nothing generated.
    kw = dict(model=None, prompt=PROMPT, temperature=0, echo=True, logprobs=2)
    scored = client.completions.create(max_tokens=0, **kw)
    one = client.completions.create(max_tokens=1, **kw).choices[0]
    n_prompt = len(tokenizer.encode(PROMPT))
    (choice,) = scored.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (n_prompt, 0)
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt and lp.token_logprobs[0] is None
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert getattr(lp, field) == getattr(one.logprobs, field)[:n_prompt]
    chunks = list(client.completions.create(max_tokens=0, stream=True, **kw))
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks] == [(PROMPT, "length")]
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs


def test_truncate_prompt_tokens_minus_one_keeps_the_context_length(client, tokenizer) -> None:
    # vLLM's -1: the prompt's last max_model_len tokens (all of a shorter one); 3: its last 3.
    kw = dict(model=None, max_tokens=3, temperature=0, extra_body={"return_token_ids": True})
    plain = client.completions.create(prompt=LONG_PROMPT, **kw).choices[0]
    whole = client.completions.create(
        prompt=LONG_PROMPT, **{**kw, "extra_body": {"return_token_ids": True, "truncate_prompt_tokens": -1}}
    )
    assert whole.choices[0].token_ids == plain.token_ids
    assert whole.usage.prompt_tokens == len(tokenizer.encode(LONG_PROMPT))
    cut = client.completions.create(
        prompt=LONG_PROMPT, **{**kw, "extra_body": {"return_token_ids": True, "truncate_prompt_tokens": 3}}
    )
    tail = client.completions.create(prompt=tokenizer.encode(LONG_PROMPT)[-3:], **kw)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].token_ids == tail.choices[0].token_ids
    chat = client.chat.completions.create(
        messages=MESSAGES, model=None, max_tokens=3, temperature=0, extra_body={"truncate_prompt_tokens": -1}
    )
    again = client.chat.completions.create(messages=MESSAGES, model=None, max_tokens=3, temperature=0)
    assert chat.choices[0].message.content == again.choices[0].message.content


def test_echo_with_logprobs(client, tokenizer) -> None:
    resp = client.completions.create(
        model=None,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = resp.choices[0]
    n_prompt = len(tokenizer.encode(PROMPT))
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])  # top-2, plus the sampled token when outside it
    streamed = list(
        client.completions.create(
            model=None,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            echo=True,
            logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    choice_stream = streamed[0].choices[0]
    assert choice_stream.text == choice.text
    assert choice_stream.logprobs.token_logprobs == lp.token_logprobs


def test_stop_strings_and_stop_token_ids(client, llm) -> None:
    ids, text, _ = offline(llm, PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    # a 2-character stop string from the second half of the greedy text (whole characters only)
    start = next(i for i in range(len(text) // 2, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    cut = text[: text.index(stop)]
    resp = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].text == cut
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["stop_reason"] == stop
    kept = client.completions.create(
        model=None,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == cut + stop
    by_id = client.completions.create(
        model=None,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [ids[3]]},
    )
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.usage.completion_tokens == ids.index(ids[3]) + 1


def test_seeded_sampling_is_reproducible_and_children_use_seed_plus_i(client) -> None:
    kw = dict(model=None, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, extra_body={"top_k": 50})
    a = client.completions.create(n=2, seed=7, **kw)
    b = client.completions.create(n=2, seed=7, **kw)
    c = client.completions.create(n=1, seed=8, **kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert a.choices[1].text == c.choices[0].text  # child 1 of seed 7 is seeded 8


def test_prefix_cache_hits_reported_as_cached_tokens(client) -> None:
    kw = dict(model=None, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    n_prompt = first.usage.prompt_tokens
    assert n_prompt >= 32
    assert second.usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // 16 * 16


def test_kv_transfer_producer_answer_and_resume(client, llm, tokenizer) -> None:
    ids = tokenizer.encode(LONG_PROMPT)
    resp = client.completions.create(
        model=None,
        prompt=LONG_PROMPT,
        max_tokens=1,
        temperature=0,
        extra_body={"kv_transfer": {"role": "producer"}},
    )
    info = resp.model_extra["kv_transfer"]
    assert info["block_hashes"] == to_hex(block_hashes(ids, 16))
    assert isinstance(info["num_cached_tokens"], int)
    full, _, _ = offline(llm, LONG_PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
    resumed = client.completions.create(
        model=None,
        prompt=ids,
        max_tokens=10,
        temperature=0,
        logprobs=0,
        extra_body={
            "ignore_eos": True,
            "resume": {"token_ids": full[:4]},
            "return_tokens_as_token_ids": True,
        },
    )
    assert ids_of(resumed.choices[0].logprobs.tokens) == full[4:]


def test_unknown_and_router_fields_are_ignored(server) -> None:
    body = {
        "prompt": "x",
        "max_completion_tokens": 3,
        "separate_reasoning": True,
        "kv_transfer_params": {"a": 1},
        "ignore_eos": True,
        "some_future_field": [1, 2],
    }
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_request_id_is_echoed_and_prefixes_the_response_id(server) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]


# ------------------------------------------------------------------ chat


def test_chat_greedy_equals_offline_llm(client, llm, tokenizer) -> None:
    resp = client.chat.completions.create(
        model=None,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    prompt_ids = tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    ids, text, _ = offline(llm, prompt_ids, max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert ids_of([t.token for t in choice.logprobs.content]) == ids
    for entry in choice.logprobs.content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy picks the top token
    assert resp.usage.prompt_tokens == len(prompt_ids) and resp.object == "chat.completion"


def test_chat_text_parts_and_max_completion_tokens(client) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    a = client.chat.completions.create(
        model=None, messages=parts, max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert a.usage.completion_tokens == 5 and a.choices[0].finish_reason == "length"


def test_chat_stream_role_first_usage_last(client) -> None:
    kw = dict(model=None, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_echo_prepends_the_continued_message(client) -> None:
    # vLLM's chat ``echo``: the answer starts with the last message when it has the answer's role.
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    kw = dict(model=None, max_tokens=4, temperature=0, n=2)
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(messages=messages, extra_body=cont, **kw)
    echoed = client.chat.completions.create(messages=messages, extra_body={**cont, "echo": True}, **kw)
    expected = ["The answer is" + c.message.content for c in plain.choices]
    assert [c.message.content for c in echoed.choices] == expected
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (
        plain.usage.prompt_tokens,
        plain.usage.completion_tokens,
    )
    streamed = ["", ""]
    for chunk in client.chat.completions.create(
        messages=messages, extra_body={**cont, "echo": True}, stream=True, **kw
    ):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == expected
    # A new turn (the answer's role is not the last message's): nothing to echo.
    turn = client.chat.completions.create(messages=MESSAGES, extra_body={"echo": True}, **kw)
    again = client.chat.completions.create(messages=MESSAGES, **kw)
    assert [c.message.content for c in turn.choices] == [c.message.content for c in again.choices]


async def test_async_client_streams_n_choices(aclient) -> None:
    stream = await aclient.chat.completions.create(
        model=None,
        messages=MESSAGES,
        max_tokens=6,
        n=3,
        seed=11,
        temperature=0.8,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    texts = {0: "", 1: "", 2: ""}
    roles = set()
    finished = set()
    role_usage = []
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
                role_usage.append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens))
            if c.finish_reason:
                finished.add(c.index)
        assert chunk.usage is not None  # continuous_usage_stats: every chunk carries usage
    assert roles == finished == {0, 1, 2}
    # The role chunks count the prompt (as vLLM's do) and no completion token yet.
    assert role_usage == [(chunk.usage.prompt_tokens, 0)] * 3 and chunk.usage.prompt_tokens > 0
    again = await aclient.chat.completions.create(
        model=None, messages=MESSAGES, max_tokens=6, n=3, seed=11, temperature=0.8
    )
    assert [again.choices[i].message.content for i in range(3)] == [texts[0], texts[1], texts[2]]


async def test_async_client_completion(aclient, llm) -> None:
    resp = await aclient.completions.create(
        model=None, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].text == offline(llm, PROMPT, max_tokens=5, temperature=0, ignore_eos=True)[1]


def test_metrics_use_vllm_names(server, scrape) -> None:
    name = server.model_name
    body = {"model": name, "prompt": PROMPT * 8, "max_tokens": 2, "ignore_eos": True}
    for _ in range(2):  # the second one hits the prefix cache
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    for metric in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
    ):
        assert scrape(server.url, metric, model_name=name) is not None, metric
    assert scrape(server.url, "vllm:request_success_total", model_name=name, finished_reason="length") > 0
    assert scrape(server.url, "vllm:prefix_cache_hits_total", model_name=name) > 0
    assert scrape(server.url, "vllm:generation_tokens_total", model_name=name) > 0
    # ferry's own counter: tokens copied from a cached partial block. A 21-token prompt answered
    # with 2 tokens leaves 16 + 6 computed (the prompt's last 5 and the first answer token); the
    # next turn, carrying that answer, copies those 6.
    # Earlier tests' cached partial blocks could match the first request's start: none left.
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=60).status_code == 200
    before = scrape(server.url, "ferry:partial_prefix_cache_hits_total", model_name=name)
    first = {"model": name, "prompt": list(range(300, 321)), "max_tokens": 2, "ignore_eos": True}
    answer = httpx.post(server.url + "/v1/completions", json={**first, "return_token_ids": True}, timeout=60)
    turn = {**first, "prompt": first["prompt"] + answer.json()["choices"][0]["token_ids"] + [400, 401]}
    assert httpx.post(server.url + "/v1/completions", json=turn, timeout=60).status_code == 200
    assert scrape(server.url, "ferry:partial_prefix_cache_hits_total", model_name=name) - before == 6


def test_per_request_histograms_of_vllms_dashboard(server, scrape) -> None:
    """What vLLM's Grafana dashboard plots per request: token counts, phase times, time per token
    (per request; and per token, as the inter-token latency and its deprecated alias)."""
    name = server.model_name
    series = (
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds",
    )
    per_token = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")

    def read() -> dict[str, tuple[float, float]]:
        return {
            s: (
                scrape(server.url, s + "_count", model_name=name) or 0.0,
                scrape(server.url, s + "_sum", model_name=name) or 0.0,
            )
            for s in series + per_token
        }

    before = read()
    body = {"model": name, "prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 5, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    after = read()
    counts = {s: after[s][0] - before[s][0] for s in series + per_token}
    sums = {s: after[s][1] - before[s][1] for s in series + per_token}
    # One per request; one per token after the first (however the server's reads grouped them).
    assert counts == {**dict.fromkeys(series, 1.0), **dict.fromkeys(per_token, 4.0)}
    assert sums["vllm:request_prompt_tokens"] == 7 and sums["vllm:request_generation_tokens"] == 5
    prefill, decode = sums["vllm:request_prefill_time_seconds"], sums["vllm:request_decode_time_seconds"]
    assert prefill > 0 and decode > 0
    assert sums["vllm:request_inference_time_seconds"] == pytest.approx(prefill + decode, rel=1e-6)
    assert sums["vllm:request_time_per_output_token_seconds"] == pytest.approx(decode / 4, rel=1e-6)
    itl = sums["vllm:inter_token_latency_seconds"]
    assert sums["vllm:time_per_output_token_seconds"] == pytest.approx(itl, rel=1e-9)


def test_choices_of_one_prompt_share_its_prefill(server, scrape) -> None:
    """n > 1: the first choice computes the prompt, the others wait for its blocks and hit them."""
    name = server.model_name
    waits = scrape(server.url, "ferry:prefix_waits_total", model_name=name)
    hits = scrape(server.url, "vllm:prefix_cache_hits_total", model_name=name)
    prompt = "a fresh prompt long enough to fill several KV blocks " * 6
    body = {"model": name, "prompt": prompt, "max_tokens": 3, "n": 3, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert len({c["text"] for c in answer["choices"]}) == 1  # greedy: three equal choices
    full = (answer["usage"]["prompt_tokens"] - 1) // 16 * 16
    assert full >= 48 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert scrape(server.url, "ferry:prefix_waits_total", model_name=name) - waits >= 2
    assert scrape(server.url, "vllm:prefix_cache_hits_total", model_name=name) - hits == 2 * full


def test_several_served_model_names(tiny_llama, serve_logs, server_process, scrape) -> None:
    """`--served-model-name primary alias` (vLLM's): either name is accepted, /v1/models lists
    both, answers and metrics carry the first."""
    srv = server_process(
        tiny_llama, ["--served-model-name", "primary", "alias", "--num-kv-blocks", "64"], serve_logs
    ).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["primary", "alias"]
        for name in ("primary", "alias"):
            r = c.completions.create(model=name, prompt="Hi", max_tokens=2)
            assert r.model == "primary"
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="other", prompt="Hi", max_tokens=2)
        assert (
            scrape(srv.url, "vllm:request_success_total", model_name="primary", finished_reason="length") == 2
        )
    finally:
        srv.stop()


def test_iteration_tokens_request_params_and_cache_config(server, scrape) -> None:
    """vLLM's vllm:iteration_tokens_total (tokens per engine step), vllm:request_params_n /
    _max_tokens (per request; per prompt of a completion) and vllm:cache_config_info."""
    name = server.model_name

    def read(metric: str, **labels: str) -> float:
        return scrape(server.url, metric, model_name=name, **labels) or 0.0

    steps, tokens = read("vllm:iteration_tokens_total_count"), read("vllm:iteration_tokens_total_sum")
    n_count, n_sum = read("vllm:request_params_n_count"), read("vllm:request_params_n_sum")
    max_sum = read("vllm:request_params_max_tokens_sum")
    body = {"model": name, "prompt": [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]], "max_tokens": 4, "n": 2}
    assert (
        httpx.post(server.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60).status_code
        == 200
    )
    # 4 sequences of 4 tokens and prompts of 7 and 3 (n = 2: 20 prompt tokens, 4 of them from the
    # prefix cache at most) in at least 4 steps; the server is otherwise idle.
    assert read("vllm:iteration_tokens_total_count") - steps >= 4
    assert 16 + 10 <= read("vllm:iteration_tokens_total_sum") - tokens <= 16 + 20
    # Cumulative buckets end at the count.
    assert read("vllm:iteration_tokens_total_bucket", le="+Inf") == read("vllm:iteration_tokens_total_count")
    assert (
        read("vllm:request_params_n_count") - n_count == 2 and read("vllm:request_params_n_sum") - n_sum == 4
    )
    assert read("vllm:request_params_max_tokens_sum") - max_sum == 8
    info = scrape(
        server.url, "vllm:cache_config_info", block_size="16", cache_dtype="auto", num_gpu_blocks="1024"
    )
    assert info == 1.0


def test_a_thinking_budget_without_a_reasoning_parser_is_a_400(client) -> None:
    # vLLM refuses a budget its server cannot enforce; the error names the flag that would.
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"thinking_token_budget": 4},
        )
    assert e.value.body["param"] == "thinking_token_budget"
    assert "needs a reasoning parser: start the server with --reasoning-parser" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model,
            prompt="hi",
            max_tokens=2,
            extra_body={"thinking_token_budget": 0},
        )
    assert e.value.body["param"] == "thinking_token_budget"
    with pytest.raises(openai.BadRequestError) as e:  # the Responses API takes it too
        client.responses.create(
            model=model,
            input="hi",
            max_output_tokens=2,
            extra_body={"thinking_token_budget": 3},
        )
    assert e.value.body["param"] == "thinking_token_budget"
    # -1 (vLLM's "no cap") needs none; include_reasoning is accepted and changes nothing here.
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"thinking_token_budget": -1, "include_reasoning": False},
    )
    assert r.choices[0].message.content is not None and r.usage.completion_tokens == 2
