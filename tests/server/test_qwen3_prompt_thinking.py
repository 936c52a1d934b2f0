"""``--reasoning-parser qwen3`` with a chat template that opens the thinking in the prompt, as
Qwen3-Thinking-2507's and Qwen3.5's do (``<think>\\n`` after the assistant header, so the model writes
only ``…</think>answer``): the answer is read as vLLM's qwen3 parser reads it, thoughts first, the same
whole and streamed. With thinking switched off (``enable_thinking: false`` puts an empty
``<think></think>`` in the prompt) the answer stays content.

The model is a tiny random Llama whose tokenizer has ``<think>`` and ``</think>``; ``logit_bias`` on
``</think>`` decides whether (and when) the greedy model ends its thoughts."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine.demo import build_model
from engine.tokenizer import Tokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
)
BODY = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 12,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def thinker(models_root: Path) -> Path:
    return build_model(models_root / "qwen3_thinker", "llama", seed=5, extra_tokens=("<think>", "</think>"))


@pytest.fixture(scope="module")
def end_id(thinker: Path) -> int:
    (end,) = Tokenizer.from_dir(thinker).encode("</think>", add_special_tokens=False)
    return end


@pytest.fixture(scope="module")
def srv(server_process, thinker: Path, serve_logs: Path, tmp_path_factory: pytest.TempPathFactory):
    template = tmp_path_factory.mktemp("qwen3_template") / "qwen3.jinja"
    template.write_text(TEMPLATE)
    proc = server_process(
        thinker, ["--reasoning-parser", "qwen3", "--chat-template", str(template)], serve_logs
    )
    proc.start()
    yield proc
    proc.stop()


def _whole(srv, body: dict) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    return {"reasoning": message.get("reasoning_content"), "content": message["content"]}


def _streamed(srv, body: dict) -> dict:
    reasoning = content = ""
    with httpx.stream(
        "POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    reasoning += c["delta"].get("reasoning_content") or ""
                    content += c["delta"].get("content") or ""
    return {"reasoning": reasoning or None, "content": content or None}


def test_thinking_opened_by_the_prompt_is_reasoning(srv, thinker: Path, end_id: int) -> None:
    # Thoughts that never end (</think> forbidden): all reasoning, as a cut-off thinking model's.
    unfinished = {**BODY, "logit_bias": {str(end_id): -100.0}}
    whole = _whole(srv, unfinished)
    assert whole["reasoning"] and whole["content"] is None and "</think>" not in whole["reasoning"]
    assert _streamed(srv, unfinished) == whole
    # Thoughts that end: the tokens before </think> are the reasoning, the text after it the answer.
    ended = {**BODY, "logit_bias": {str(end_id): 1.5}, "return_token_ids": True}
    r = httpx.post(srv.url + "/v1/chat/completions", json=ended, timeout=60)
    ids = r.json()["choices"][0]["token_ids"]
    assert end_id in ids[1:]  # this greedy model thinks a few tokens, then ends its thoughts
    whole = _whole(srv, ended)
    tokenizer = Tokenizer.from_dir(thinker)
    assert whole["reasoning"] == tokenizer.decode(ids[: ids.index(end_id)])
    assert whole["content"] and whole["reasoning"] + "</think>" + whole["content"] == tokenizer.decode(ids)
    assert _streamed(srv, ended) == whole


def test_thinking_switched_off_is_content(srv, end_id: int) -> None:
    off = {**BODY, "logit_bias": {str(end_id): -100.0}, "chat_template_kwargs": {"enable_thinking": False}}
    whole = _whole(srv, off)
    assert whole["reasoning"] is None and whole["content"]
    assert _streamed(srv, off) == whole
    # The same greedy tokens as with thinking on (the prompts differ in the closed tag only after
    # the header, so compare shapes, not text): what was reasoning there is content here.
    on = _whole(srv, {**BODY, "logit_bias": {str(end_id): -100.0}})
    assert on["content"] is None and on["reasoning"]


# ------------------------------------------------ vLLM's reasoning fields, through the OpenAI SDK
# vLLM writes the thinking as ``reasoning`` (its name since the rename) and ``reasoning_content``
# (the old one) with the same text; ``include_reasoning: false`` leaves it out; a
# ``thinking_token_budget`` of k ends the thinking after k tokens (the prompt's "\n" after <think>
# is the first of them, as vLLM counts from the start marker) by forcing </think>.


MODEL = "qwen3_thinker"  # the served name: the model directory's


@pytest.fixture(scope="module")
def sdk(srv):  # noqa: ANN201 - openai.OpenAI
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _sdk_args(extra_body: dict, **body) -> dict:
    sdk_fields = {k: v for k, v in BODY.items() if k != "ignore_eos"}
    extra = {"ignore_eos": True, "return_token_ids": True, **extra_body}
    return {"model": MODEL, **sdk_fields, **body, "extra_body": extra}


def _sdk_whole(sdk, extra_body: dict, **body) -> tuple[dict, list[int], object]:
    r = sdk.chat.completions.create(**_sdk_args(extra_body, **body))
    choice = r.choices[0]
    return choice.message.model_dump(exclude_none=True), choice.model_extra["token_ids"], r


def _sdk_stream(sdk, extra_body: dict, **body) -> tuple[list[dict], list[int]]:
    deltas, ids = [], []
    for chunk in sdk.chat.completions.create(**_sdk_args(extra_body, **body), stream=True):
        for choice in chunk.choices:
            deltas.append(choice.delta.model_dump(exclude_none=True))
            ids += choice.model_extra.get("token_ids") or []
    return deltas, ids


def _joined(deltas: list[dict], key: str) -> str | None:
    return "".join(d.get(key) or "" for d in deltas) or None


def test_reasoning_comes_under_both_names(sdk, end_id: int) -> None:
    ended = {"logit_bias": {str(end_id): 1.5}}
    message, _, _ = _sdk_whole(sdk, extra_body=ended)
    assert message["reasoning"] and message["content"]
    assert message["reasoning_content"] == message["reasoning"]
    deltas, _ = _sdk_stream(sdk, extra_body=ended)
    thoughts = [d for d in deltas if "reasoning" in d or "reasoning_content" in d]
    assert thoughts and all(d["reasoning"] == d["reasoning_content"] for d in thoughts)
    assert _joined(deltas, "reasoning") == message["reasoning"]
    assert _joined(deltas, "content") == message["content"]


def test_include_reasoning_false_leaves_the_thinking_out(sdk, end_id: int) -> None:
    ended = {"logit_bias": {str(end_id): 1.5}}
    shown, ids, _ = _sdk_whole(sdk, extra_body=ended)
    hidden, hidden_ids, _ = _sdk_whole(sdk, extra_body={**ended, "include_reasoning": False})
    assert shown["reasoning"] and hidden_ids == ids
    assert hidden == {"role": "assistant", "content": shown["content"]}
    deltas, stream_ids = _sdk_stream(sdk, extra_body={**ended, "include_reasoning": False})
    assert stream_ids == ids
    assert not any("reasoning" in d or "reasoning_content" in d for d in deltas)
    assert _joined(deltas, "content") == shown["content"]


def test_a_thinking_token_budget_forces_the_end_of_thinking(sdk, thinker: Path, end_id: int) -> None:
    tokenizer = Tokenizer.from_dir(thinker)
    in_prompt = len(tokenizer.encode("<think>\n", add_special_tokens=False)) - 1  # the "\n" counts
    assert in_prompt == 1
    never = {"logit_bias": {str(end_id): -100.0}}  # this greedy model would think to the end
    free, free_ids, _ = _sdk_whole(sdk, extra_body=never)
    assert end_id not in free_ids and "content" not in free
    for budget in (0, 1, 4):
        generated = max(budget - in_prompt, 0)
        message, ids, r = _sdk_whole(
            sdk, logprobs=True, extra_body={**never, "thinking_token_budget": budget}
        )
        # Exactly the free answer's first thoughts, then </think>, then the answer goes on as content.
        assert ids[: generated + 1] == [*free_ids[:generated], end_id] and end_id not in ids[generated + 1 :]
        assert r.usage.completion_tokens == len(ids) == BODY["max_tokens"]
        assert r.choices[0].finish_reason == "length"
        assert [t.token for t in r.choices[0].logprobs.content][generated] == "</think>"
        assert message.get("reasoning") == (tokenizer.decode(ids[:generated]) or None)
        assert message["content"] == tokenizer.decode(ids[generated + 1 :]).lstrip("\n")
        deltas, stream_ids = _sdk_stream(sdk, extra_body={**never, "thinking_token_budget": budget})
        assert stream_ids == ids and _joined(deltas, "content") == message["content"]
    # -1 is vLLM's "no cap": the free answer.
    assert _sdk_whole(sdk, extra_body={**never, "thinking_token_budget": -1})[1] == free_ids


def test_completions_take_the_budget_too(sdk, end_id: int) -> None:
    # A raw prompt that ends at <think>: no thinking token yet, so a budget of 2 is two generated.
    body = {"model": MODEL, "prompt": "hi<think>", "max_tokens": 6, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True, "logit_bias": {str(end_id): -100.0}}
    free = sdk.completions.create(**body, extra_body=extra).choices[0].model_extra["token_ids"]
    capped = sdk.completions.create(**body, extra_body={**extra, "thinking_token_budget": 2})
    ids = capped.choices[0].model_extra["token_ids"]
    assert end_id not in free and ids[:3] == [*free[:2], end_id] and end_id not in ids[3:]


def test_bad_reasoning_fields_are_400s(sdk) -> None:
    import openai

    for field, value in (
        ("thinking_token_budget", -2),
        ("thinking_token_budget", 2.5),
        ("thinking_token_budget", "3"),
        ("thinking_token_budget", True),
        ("include_reasoning", "no"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(**_sdk_args({field: value}))
        assert e.value.status_code == 400 and e.value.body["param"] == field, (field, value)
        assert e.value.body["message"].startswith(f"Invalid value for '{field}': "), e.value.body


def test_anthropic_thinking_budget_tokens_is_the_budget(srv, end_id: int) -> None:
    import anthropic

    claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
    never = {"logit_bias": {str(end_id): -100.0}, "temperature": 0}

    def blocks(**extra) -> list[tuple[str, str]]:
        m = claude.messages.create(
            model=MODEL, max_tokens=BODY["max_tokens"], messages=BODY["messages"], **extra
        )
        return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in m.content]

    # The chat answer with the same budget (3: the prompt's "\n" and two thoughts) is the message's.
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={**BODY, **never, "thinking_token_budget": 3, "ignore_eos": False},
        timeout=60,
    ).json()["choices"][0]["message"]
    budgeted = blocks(thinking={"type": "enabled", "budget_tokens": 3}, extra_body=never)
    assert budgeted == [("thinking", r["reasoning"]), ("text", r["content"])]
    assert blocks(extra_body=never)[0][1] != r["reasoning"]  # without it, the model thinks on


# ---------------------------------------------------------- the Responses API on the same server
# The thought is a reasoning item (vLLM's reasoning_text content, or with reasoning.summary the
# item's summary, streamed with OpenAI's summary events), usage counts its tokens exactly, and
# vLLM's include_reasoning and thinking_token_budget work as on chat.

BUDGET = 4  # the prompt's "\n" and 3 generated thoughts, then </think>


def _responses_args(**extra: object) -> dict:
    body = {"ignore_eos": True, "logit_bias": {"0": 0.0}, "thinking_token_budget": BUDGET, **extra}
    return {"model": MODEL, "input": "hi", "max_output_tokens": 12, "temperature": 0, "extra_body": body}


@pytest.fixture(scope="module")
def budgeted(sdk, end_id: int) -> tuple[str, str]:
    """The chat answer (thought, content) the Responses requests below must give."""
    never = {"logit_bias": {str(end_id): -100.0}, "thinking_token_budget": BUDGET}
    message, ids, _ = _sdk_whole(sdk, extra_body=never)
    assert ids[BUDGET - 1] == end_id and message["reasoning"] and message["content"]
    return message["reasoning"], message["content"]


def test_responses_reasoning_item_and_exact_reasoning_tokens(sdk, end_id: int, budgeted) -> None:
    thought, content = budgeted
    args = _responses_args(logit_bias={str(end_id): -100.0})
    r = sdk.responses.create(**args)
    reasoning, message = r.output
    assert (reasoning.type, reasoning.summary, [c.model_dump() for c in reasoning.content]) == (
        "reasoning",
        [],
        [{"type": "reasoning_text", "text": thought}],
    )
    assert message.type == "message" and r.output_text == content  # no thought in output_text
    assert (r.usage.output_tokens, r.usage.output_tokens_details.reasoning_tokens) == (12, BUDGET - 1)
    # include_reasoning false (vLLM's): no reasoning item, the same answer and usage.
    hidden = sdk.responses.create(
        **{**args, "extra_body": {**args["extra_body"], "include_reasoning": False}}
    )
    assert [item.type for item in hidden.output] == ["message"] and hidden.output_text == content
    assert hidden.usage.output_tokens_details.reasoning_tokens == BUDGET - 1
    # Streamed: the same items and usage, the thought as reasoning_text deltas.
    # (max_output_tokens cuts it: the stream ends with response.incomplete, whose response is final)
    with sdk.responses.stream(**args) as stream:
        events = list(stream)
    kinds, final = [event.type for event in events], events[-1].response
    assert kinds[-1] == "response.incomplete"
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [
        i.model_dump(exclude={"id"}) for i in r.output
    ]
    assert final.usage.output_tokens_details.reasoning_tokens == BUDGET - 1
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thought and "response.reasoning_summary_text.delta" not in kinds


def test_responses_reasoning_summary_is_the_thought(sdk, end_id: int, budgeted) -> None:
    thought, content = budgeted
    args = _responses_args(logit_bias={str(end_id): -100.0})
    for key in ("summary", "generate_summary"):  # the latter: OpenAI's deprecated name
        r = sdk.responses.create(**args, reasoning={key: "auto"})
        reasoning = r.output[0]
        assert (reasoning.summary[0].model_dump(), reasoning.content) == (
            {"type": "summary_text", "text": thought},
            None,
        )
        assert r.output_text == content and r.usage.output_tokens_details.reasoning_tokens == BUDGET - 1
    with sdk.responses.stream(**args, reasoning={"summary": "detailed"}) as stream:
        events = list(stream)
    final = events[-1].response
    item_id = final.output[0].id
    mine = [e for e in events if getattr(e, "item_id", None) == item_id or getattr(e, "item", None)]
    kinds = [e.type for e in mine if getattr(e, "output_index", None) == 0]
    # (however many deltas the engine's steps came in: those read together are one)
    kinds = [k for i, k in enumerate(kinds) if not (i and k == kinds[i - 1] and k.endswith(".delta"))]
    assert kinds == [
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
    ]
    deltas = "".join(e.delta for e in mine if e.type == "response.reasoning_summary_text.delta")
    assert deltas == thought and final.output[0].summary[0].text == thought
    assert {e.summary_index for e in mine if "summary" in e.type} == {0}
    assert "response.reasoning_text.delta" not in [e.type for e in events]
    assert final.output_text == content
    import openai

    with pytest.raises(openai.BadRequestError) as e:  # not one of OpenAI's three
        sdk.responses.create(**args, reasoning={"summary": "verbose"})
    assert e.value.status_code == 400
