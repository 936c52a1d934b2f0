"""Offline chat (vLLM's ``LLM.chat`` and ``LLM.get_tokenizer``): conversations rendered with the
model's template (or one given), encoded as the server encodes them, generated as ``generate``;
and vLLM's prompt dicts and ``use_tqdm`` taken by ``generate``, ``chat`` and ``embed``."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.chat_template import ChatTemplateError

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
OTHER = [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    with LLM(str(tiny_llama), num_kv_blocks=64, num_threads=1) as llm:
        yield llm


def test_chat_equals_generate_on_the_rendered_prompt(llm) -> None:
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer
    outs = llm.chat([CHAT, OTHER], GREEDY)
    for out, messages in zip(outs, (CHAT, OTHER), strict=True):
        ids = tok.encode_chat(messages, add_generation_prompt=True)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    one = llm.chat(CHAT, GREEDY)  # a single conversation
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_template_options(llm) -> None:
    tok = llm.get_tokenizer()
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}=>"
    out = llm.chat(CHAT, GREEDY, chat_template=own)[0]
    assert out.prompt_token_ids == tok.encode(
        "[system] be brief [user] hello there =>", add_special_tokens=False
    )
    partial = [*CHAT, {"role": "assistant", "content": "Hi, I am"}]
    cont = llm.chat(partial, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert tok.decode(cont.prompt_token_ids, skip_special_tokens=False).endswith("Hi, I am")
    with pytest.raises(ChatTemplateError):
        llm.chat(CHAT, GREEDY, chat_template="{% for m in messages %}")
    # chat_template_kwargs join the template's variables; the arguments win over their spelling
    # there, as vLLM merges them.
    shows = "{{ mood }} {{ add_generation_prompt }} {{ tools | length }}"
    kwargs = {"mood": "calm", "add_generation_prompt": False, "tools": [1, 2]}
    out = llm.chat(CHAT, GREEDY, chat_template=shows, tools=[3], chat_template_kwargs=kwargs)[0]
    assert out.prompt_token_ids == tok.encode("calm True 1", add_special_tokens=False)


def test_vllm_prompt_dicts_and_use_tqdm(llm) -> None:
    ids = llm.get_tokenizer().encode("hello there")
    plain = llm.generate(["hello there", ids], GREEDY)
    dicts = llm.generate([{"prompt": "hello there"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    one = llm.generate({"prompt_token_ids": ids}, GREEDY)  # a single dict
    assert one[0].prompt_token_ids == ids
    assert llm.embed([{"prompt": "hi"}], use_tqdm=True) == llm.embed(["hi"])
    assert len(llm.chat(CHAT, GREEDY, use_tqdm=False)) == 1
    with pytest.raises(ValueError, match="takes 'prompt' .* or 'prompt_token_ids'"):
        llm.generate([{"prompt": "x", "mm_processor_kwargs": {}}], GREEDY)
    from PIL import Image

    image = Image.new("RGB", (8, 8))
    with pytest.raises(ValueError, match="takes text only"):  # images need a vision-language model
        llm.generate([{"prompt": "x", "multi_modal_data": {"image": image}}], GREEDY)
