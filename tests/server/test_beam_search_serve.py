"""vLLM's ``use_beam_search`` through `ferry serve`: completions and chat answer with the n best
beams, the same as the offline ``LLM.beam_search`` on the same checkpoint, streamed or not, in one
API server process or several; what cannot combine with a beam search is a 400; a client gone or a
timeout aborts the search and frees its blocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, BeamSearchParams

PROMPTS = [[5, 9, 14, 3, 77, 31], [400, 12, 800, 33, 7, 91, 250]]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Iterator[LLM]:
    with LLM(str(tiny_llama), num_kv_blocks=256, num_threads=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _offline(llm: LLM, prompt: list[int], **params) -> list:
    return llm.beam_search([prompt], BeamSearchParams(**params))[0].sequences


def _check_completions(client: openai.OpenAI, model: str, llm: LLM) -> None:
    r = client.completions.create(
        model=model,
        prompt=PROMPTS,
        n=3,
        max_tokens=8,
        logprobs=2,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True},
    )
    assert [c.index for c in r.choices] == list(range(6))
    completion_tokens = 0
    for p, prompt in enumerate(PROMPTS):
        beams = _offline(llm, prompt, beam_width=3, max_tokens=8, ignore_eos=True, logprobs=2)
        for i, beam in enumerate(beams):
            choice = r.choices[p * 3 + i]
            assert choice.token_ids == beam.tokens[len(prompt) :]
            assert choice.text == beam.text
            assert choice.finish_reason == "length"
            chosen = [entry[t].logprob for t, entry in zip(choice.token_ids, beam.logprobs, strict=True)]
            assert choice.logprobs.token_logprobs == pytest.approx(chosen, abs=1e-4)
            # The two most likely tokens at each position, and the chosen one where it is not.
            for token_id, top, entry in zip(
                choice.token_ids, choice.logprobs.top_logprobs, beam.logprobs, strict=True
            ):
                assert len(top) == 2 + (entry[token_id].rank > 2)
            completion_tokens += len(choice.token_ids)
    assert r.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert r.usage.completion_tokens == completion_tokens == 48


def test_completion_beams_equal_offline_beam_search(server, client, llm, scrape) -> None:
    name = server.model_name
    before = scrape(server.url, "vllm:request_success_total", model_name=name, finished_reason="length") or 0
    _check_completions(client, name, llm)
    # Each choice counts as one finished request, not each of the search's engine steps.
    after = scrape(server.url, "vllm:request_success_total", model_name=name, finished_reason="length")
    assert after == before + 6


def test_streamed_beams_come_whole_once_each(client, server) -> None:
    body = dict(model=server.model_name, prompt=PROMPTS[0], n=3, max_tokens=8)
    extra = {"use_beam_search": True, "ignore_eos": True}
    whole = client.completions.create(**body, extra_body=extra)
    chunks = list(
        client.completions.create(
            **body, extra_body=extra, stream=True, stream_options={"include_usage": True}
        )
    )
    choice_chunks = [c for c in chunks if c.choices]
    assert sorted(c.choices[0].index for c in choice_chunks) == [0, 1, 2]
    texts = {c.choices[0].index: c.choices[0].text for c in choice_chunks}
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert all(c.choices[0].finish_reason == "length" for c in choice_chunks)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 24


def test_chat_beams_equal_offline_beam_search(server, client, llm) -> None:
    prompt = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    r = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,
        n=2,
        max_tokens=6,
        logprobs=True,
        top_logprobs=1,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    beams = _offline(llm, prompt, beam_width=2, max_tokens=6, length_penalty=0.5, logprobs=1)
    assert [c.message.content for c in r.choices] == [b.text for b in beams]
    assert [c.finish_reason for c in r.choices] == [b.finish_reason for b in beams]
    for choice, beam in zip(r.choices, beams, strict=True):
        assert len(choice.logprobs.content) == len(beam.tokens) - len(prompt)
    streamed = list(
        client.chat.completions.create(
            model=server.model_name,
            messages=MESSAGES,
            n=2,
            max_tokens=6,
            stream=True,
            extra_body={"use_beam_search": True, "length_penalty": 0.5},
        )
    )
    roles = [c for c in streamed if c.choices[0].delta.role == "assistant"]
    assert [c.choices[0].index for c in roles] == [0, 1]  # role chunks first, as always
    content = {c.choices[0].index: c.choices[0].delta.content for c in streamed[2:]}
    assert [content[0], content[1]] == [b.text for b in beams]


def test_stop_strings_end_beams_as_offline(client, server, llm) -> None:
    prompt = PROMPTS[1]
    plain = _offline(llm, prompt, beam_width=3, max_tokens=8, ignore_eos=True)
    stop = plain[0].text[2:4]  # reached by the best beam, so the search must end some beam on it
    for include in (False, True):
        r = client.completions.create(
            model=server.model_name,
            prompt=prompt,
            n=3,
            max_tokens=8,
            stop=[stop],
            extra_body={"use_beam_search": True, "ignore_eos": True, "include_stop_str_in_output": include},
        )
        beams = _offline(
            llm,
            prompt,
            beam_width=3,
            max_tokens=8,
            ignore_eos=True,
            stop=(stop,),
            include_stop_str_in_output=include,
        )
        assert [(c.text, c.finish_reason) for c in r.choices] == [(b.text, b.finish_reason) for b in beams]
        stopped = [c for c in r.choices if c.finish_reason == "stop"]
        assert stopped and all(c.stop_reason == stop for c in stopped)
        assert all(c.text.endswith(stop) == include for c in stopped)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"5": 3.0}}, "logit_bias"),
        ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"response_format": {"type": "json_object"}}, "use_beam_search"),
        ({"guided_regex": "[ab]+"}, "use_beam_search"),
        ({"n": 11}, "n"),  # 22 candidates per beam: over --max-logprobs 20
        ({"resume": {"token_ids": [5]}}, "resume"),
    ],
)
def test_what_cannot_combine_with_beam_search_is_a_400(server, extra, param) -> None:
    body = {"prompt": "x", "max_tokens": 4, "n": 2, "use_beam_search": True, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError"
    assert httpx.get(server.url + "/health").status_code == 200


def _queries(url: str, scrape, model: str) -> float:
    # Every step of a search looks its beams up in the prefix cache: the count moves while it runs.
    return scrape(url, "vllm:prefix_cache_queries_total", model_name=model) or 0.0


def _wait_stopped(url: str, scrape, model: str, timeout: float = 60) -> None:
    """Until the engine does no more work (its lookups stop) and holds no KV block. The bound only
    guards against a hang: the abort counter shows that an abort, not a run to the end, stopped it."""
    deadline = time.monotonic() + timeout
    last = _queries(url, scrape, model)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = _queries(url, scrape, model)
        idle = scrape(url, "vllm:num_requests_running", model_name=model) == 0
        if now == last and idle and scrape(url, "vllm:kv_cache_usage_perc", model_name=model) == 0:
            return
        last = now
    raise AssertionError("the engine kept working")


# The series every request ends in, once.
_ENDS = (
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
)


async def test_client_gone_mid_search_aborts_it(server, scrape) -> None:
    name = server.model_name
    aborted = scrape(server.url, "vllm:request_success_total", model_name=name, finished_reason="abort") or 0
    ended = {s: scrape(server.url, s, model_name=name) or 0 for s in _ENDS}
    body = {"prompt": "x", "n": 4, "max_tokens": 500, "ignore_eos": True, "use_beam_search": True}
    start = _queries(server.url, scrape, name)
    async with httpx.AsyncClient(timeout=60) as http:
        task = asyncio.ensure_future(http.post(server.url + "/v1/completions", json=body))
        deadline = time.monotonic() + 60
        while _queries(server.url, scrape, name) <= start + 50:  # some steps in
            assert time.monotonic() < deadline, "the search never ran"
            await asyncio.sleep(0.02)
        task.cancel()  # closes the connection
        with pytest.raises(asyncio.CancelledError):
            await task
    _wait_stopped(server.url, scrape, name)
    after = scrape(server.url, "vllm:request_success_total", model_name=name, finished_reason="abort")
    assert after == aborted + 4  # its four choices
    # ... each counted in every series a request ends in, with its prompt and the tokens it had.
    assert {s: scrape(server.url, s, model_name=name) - ended[s] for s in _ENDS} == dict.fromkeys(_ENDS, 4)


@pytest.fixture(scope="module")
def two_api_servers(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = ["--api-server-count", "2", "--request-timeout", "2", "--num-kv-blocks", "512"]
    srv = server_process(tiny_llama, flags, serve_logs).start()
    yield srv
    srv.stop()


def test_beam_search_across_api_server_processes(two_api_servers, llm, scrape) -> None:
    srv = two_api_servers
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    _check_completions(client, srv.model_name, llm)
    # --request-timeout ends a search that runs past it, and frees what it held. (Eight beams of
    # 1,000 tokens: a 2-core EPYC VM runs four in 1.85 s, under the timeout.)
    body = {"prompt": "x", "n": 8, "max_tokens": 1000, "ignore_eos": True, "use_beam_search": True}
    aborted = scrape(
        srv.url, "vllm:request_success_total", model_name=srv.model_name, finished_reason="abort"
    )
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    _wait_stopped(srv.url, scrape, srv.model_name)
    after = scrape(srv.url, "vllm:request_success_total", model_name=srv.model_name, finished_reason="abort")
    assert (after or 0) == (aborted or 0) + 8  # its eight beams, aborted (not run to their length)
