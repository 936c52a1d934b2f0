"""`ferry serve` of a DeepSeek-V3 checkpoint (MLA + MoE) through the OpenAI SDK, with DeepSeek's
own tool-call format read back (``--tool-call-parser deepseek_v3``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from tests.server.conftest import ServerProcess

PROMPT = [11 + (i * 37) % 900 for i in range(40)]


@pytest.fixture(scope="module")
def deepseek_server(tiny_deepseek: Path, serve_logs: Path) -> Iterator[ServerProcess]:
    flags = ["--num-kv-blocks", "64", "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3"]
    proc = ServerProcess(tiny_deepseek, flags, serve_logs).start()
    yield proc
    proc.stop()


def test_completion_and_chat_stream_equal_the_offline_engine(
    tiny_deepseek: Path, deepseek_server: ServerProcess
) -> None:
    client = openai.OpenAI(base_url=deepseek_server.url + "/v1", api_key="x")
    llm = LLM(str(tiny_deepseek), num_kv_blocks=64)
    want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    got = client.completions.create(
        model=deepseek_server.model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert got.choices[0].token_ids == want.outputs[0].token_ids  # type: ignore[attr-defined]
    # The same prompt again: its two full blocks of latents come from the prefix cache.
    again = client.completions.create(
        model=deepseek_server.model_name, prompt=PROMPT, max_tokens=1, temperature=0
    )
    assert again.usage is not None and again.usage.prompt_tokens_details.cached_tokens == 32

    messages = [{"role": "user", "content": "Name a prime number."}]
    prompt_ids = Tokenizer.from_dir(tiny_deepseek).encode_chat(messages, add_generation_prompt=True)
    chat_want = llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    stream = client.chat.completions.create(
        model=deepseek_server.model_name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat_want.outputs[0].text and len(chat_want.outputs[0].token_ids) == 10


NOW_TOOL = {
    "type": "function",
    "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
}
# The random model is steered into DeepSeek-V3's tool-call format; the parser reads it back.
DEEPSEEK_CALL = (
    r"Checking\.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n"
    r"\{\}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)


def test_auto_tool_call_in_deepseek_format(deepseek_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=deepseek_server.url + "/v1", api_key="x")
    kw = dict(
        model=deepseek_server.model_name,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[NOW_TOOL],
        max_tokens=120,
        temperature=0,
        extra_body={"guided_regex": DEEPSEEK_CALL},
    )
    r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert [(t.function.name, t.function.arguments) for t in choice.message.tool_calls] == [("now", "{}")]
    content, names, args, finish = "", [], "", None
    for chunk in client.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                names += [d.function.name] if d.function and d.function.name else []
                args += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    assert (content, names, args, finish) == ("Checking.", ["now"], "{}", "tool_calls")
