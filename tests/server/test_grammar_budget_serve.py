"""Over HTTP, a request whose structured-outputs grammar costs the engine thread more than
``--structured-outputs-mask-budget-ms`` a token is ended as it runs: a 400 naming the cost and the
flag (code ``structured_outputs_too_costly``) when nothing was sent yet, an error event in a stream
already started; counted as an abort and in ``ferry:structured_outputs_too_costly``; the replica
serves on. The grammar is a real costly one
(``tests/engine/test_grammar_budget.py``: 4-160 ms a token here, the budget 1 ms)."""

from __future__ import annotations

import openai
import pytest

COSTLY = {"grammar": "root ::= ([^x]{0,10}){0,100}"}
MESSAGE_START = "The structured outputs constraint was ended: enforcing it cost "
FLAG = "above the 1 ms a token this server allows (--structured-outputs-mask-budget-ms)"


@pytest.fixture(scope="module", params=[1, 2], ids=["engine-thread", "engine-process"])
def budgeted(request, tiny_llama, serve_logs, server_process):
    """One API server over the engine thread, or two over an engine process (the error then
    crosses the process boundary with the output)."""
    flags = ["--num-kv-blocks", "256", "--structured-outputs-mask-budget-ms", "1"]
    srv = server_process(tiny_llama, [*flags, "--api-server-count", str(request.param)], serve_logs)
    yield srv.start()
    srv.stop()


@pytest.fixture(scope="module")
def sdk(budgeted):
    return openai.OpenAI(base_url=budgeted.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_costly_grammar_is_a_400_naming_its_cost(sdk, budgeted, scrape) -> None:
    aborts = scrape(budgeted.url, "vllm:request_success_total", finished_reason="abort")
    ended = scrape(budgeted.url, "ferry:structured_outputs_too_costly_total")
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(
            model=budgeted.model_name,
            prompt="hi",
            max_tokens=30,
            temperature=0.0,
            extra_body={"structured_outputs": COSTLY},
        )
    body = err.value.body
    assert (err.value.status_code, body["code"], body["type"]) == (
        400,
        "structured_outputs_too_costly",
        "BadRequestError",
    )
    assert body["message"].startswith(MESSAGE_START) and FLAG in body["message"]
    assert scrape(budgeted.url, "vllm:request_success_total", finished_reason="abort") == aborts + 1
    assert scrape(budgeted.url, "ferry:structured_outputs_too_costly_total") == ended + 1
    # The replica serves on: a plain request runs to its length.
    done = sdk.completions.create(
        model=budgeted.model_name, prompt="hi", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert (done.choices[0].finish_reason, done.usage.completion_tokens) == ("length", 5)


def test_a_stream_already_started_ends_with_an_error_event(sdk, budgeted) -> None:
    stream = sdk.chat.completions.create(
        model=budgeted.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=30,
        temperature=0.0,
        stream=True,
        extra_body={"structured_outputs": COSTLY},
    )
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert str(err.value.message).startswith(MESSAGE_START) and FLAG in str(err.value.message)
