"""`ferry serve` of a gpt-oss checkpoint (attention sinks, sliding/full layers, biased MoE) answering
a chat request through the OpenAI SDK, with the offline engine's tokens."""

from __future__ import annotations

from pathlib import Path

import openai

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from tests.server.conftest import ServerProcess


def test_chat_answers_as_the_offline_engine(tiny_gpt_oss: Path, serve_logs: Path) -> None:
    messages = [{"role": "user", "content": "Count past the sliding window: one two three four five six."}]
    prompt_ids = Tokenizer.from_dir(tiny_gpt_oss).encode_chat(messages, add_generation_prompt=True)
    assert len(prompt_ids) > 8  # longer than the model's window
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = LLM(str(tiny_gpt_oss), num_kv_blocks=64).generate([prompt_ids], params)[0].outputs[0]
    srv = ServerProcess(tiny_gpt_oss, ["--num-kv-blocks", "64"], serve_logs).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        got = client.chat.completions.create(
            model=srv.model_name,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    finally:
        srv.stop()
    assert got.choices[0].message.content == want.text
    assert got.usage is not None and got.usage.completion_tokens == 12
    assert got.usage.prompt_tokens == len(prompt_ids)
