"""Over HTTP, a structured-outputs constraint that reaches a dead end (it allowed the tokens
generated, then allows none) ends its request with a 400 ``structured_outputs_dead_end`` naming the
dead end, or an error event in a stream already started; counted as an abort and in
``ferry:structured_outputs_dead_end``. A constraint with no sentence at all (an empty character
class on every path, a JSON pattern that matches no text) is a 400 before it runs.
The replica serves on."""

from __future__ import annotations

import openai
import pytest

from engine.grammar_matcher import DEAD_END
from engine.tokenizer import Tokenizer

# Not empty ("b" is in it): it runs; the model, pushed to "a", meets the branch that matches
# nothing after it.
ONE_BRANCH_DEAD = {"regex": "b|a[^\\s\\S]"}


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def to_a(tiny_llama) -> dict[str, float]:
    """A logit bias that makes "a" the model's first token."""
    return {str(Tokenizer.from_dir(tiny_llama).encode("a")[-1]): 100.0}


def test_a_dead_end_is_a_400_naming_it(sdk, server, scrape, to_a) -> None:
    aborts = scrape(server.url, "vllm:request_success_total", finished_reason="abort") or 0
    ended = scrape(server.url, "ferry:structured_outputs_dead_end_total") or 0
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(
            model=server.model_name,
            prompt="hi",
            max_tokens=10,
            temperature=0.0,
            logit_bias=to_a,
            extra_body={"structured_outputs": ONE_BRANCH_DEAD},
        )
    body = err.value.body
    assert (err.value.status_code, body["code"]) == (400, "structured_outputs_dead_end")
    assert body["message"].startswith(DEAD_END + " after the 1 token(s) generated ('a')")
    assert scrape(server.url, "vllm:request_success_total", finished_reason="abort") == aborts + 1
    assert scrape(server.url, "ferry:structured_outputs_dead_end_total") == ended + 1
    done = sdk.completions.create(
        model=server.model_name, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert (done.choices[0].finish_reason, done.usage.completion_tokens) == ("length", 3)


def test_a_stream_already_started_ends_with_an_error_event(sdk, server, to_a) -> None:
    stream = sdk.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        temperature=0.0,
        stream=True,
        logit_bias=to_a,
        extra_body={"structured_outputs": ONE_BRANCH_DEAD},
    )
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert str(err.value.message).startswith(DEAD_END)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            {"regex": "a[^\\s\\S]"},
            "invalid structured outputs regex: no output can satisfy it (every way through it needs an empty",
        ),
        (
            {"json": {"type": "string", "pattern": "^a[^\\s\\S]$"}},
            "invalid structured outputs json: the pattern '^a[^\\\\s\\\\S]$' matches no text (every way",
        ),
    ],
    ids=["empty-class", "pattern-matches-nothing"],
)
def test_a_constraint_with_no_sentence_is_a_400_before_it_runs(
    sdk, server, stream, constraint, message
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(
            model=server.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=10,
            stream=stream,
            extra_body={"structured_outputs": constraint},
        )
    assert err.value.status_code == 400
    assert err.value.body["message"].startswith(message)
