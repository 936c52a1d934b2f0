"""Offline chat (vLLM's ``LLM.chat`` and ``LLM.get_tokenizer``): conversations rendered with the
model's template (or one given), encoded as the server encodes them, generated as ``generate``;
and vLLM's prompt dicts and ``use_tqdm`` taken by ``generate``, ``chat`` and ``embed``; vLLM's
constructor options (engine/llm_options.py) and ``reset_prefix_cache``."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.chat_template import ChatTemplateError
from engine.llm_options import take_vllm_options

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
OTHER = [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    # Built as a vLLM script builds it: options ferry has no use for are taken (and logged).
    vllm = {"tensor_parallel_size": 1, "enforce_eager": True, "trust_remote_code": True, "swap_space": 4}
    with LLM(model=str(tiny_llama), num_kv_blocks=64, num_threads=1, **vllm) as llm:
        yield llm


def test_vllm_constructor_options(caplog) -> None:
    options = {"enforce_eager": True, "task": "embed", "cpu_offload_gb": 0, "max_model_len": 64}
    with caplog.at_level("INFO", logger="engine.llm"):
        take_vllm_options(options)
    assert options == {"max_model_len": 64}  # an EngineConfig field stays
    assert "enforce_eager is accepted for vLLM compatibility and changes nothing" in caplog.text
    assert "LLM option task" in caplog.text
    for name, value in (("tensor_parallel_size", 2), ("data_parallel_size", 4), ("cpu_offload_gb", 8)):
        with pytest.raises(ValueError, match=f"{name}={value}: .*{name}=[01] only"):
            take_vllm_options({name: value})
    with pytest.raises(TypeError, match="unknown engine option.*: nonsense"):
        LLM(nonsense=1)


def test_reset_prefix_cache_and_output_fields(llm) -> None:
    ids = list(range(5, 40))  # two full blocks of 16
    first = llm.generate([ids], GREEDY, use_tqdm=lambda *a, **k: None)[0]  # vLLM's tqdm factory form
    assert first.lora_request is None and first.num_cached_tokens == 0
    assert llm.generate([ids], GREEDY)[0].num_cached_tokens == 32
    assert llm.reset_prefix_cache() is True
    assert llm.generate([ids], GREEDY)[0].num_cached_tokens == 0


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


def test_tokenizer_has_transformers_special_ids(llm, tiny_llama: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(tiny_llama))
    tok = llm.get_tokenizer()
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (
        hf.eos_token_id,
        hf.bos_token_id,
        hf.pad_token_id,
    )
    assert tok.eos_token_id is not None and tok.pad_token_id is not None


def test_sampling_params_bad_words_and_clone(llm) -> None:
    """vLLM's ``bad_words`` (words, tokenized by the engine alone and after a space) and ``clone``."""
    from engine.sampling_params import bad_word_sequences

    tok = llm.get_tokenizer()
    ids = tok.encode("hello there")
    free = llm.generate([ids], GREEDY)[0].outputs[0]
    word = tok.decode(free.token_ids[:1]).strip() or "x"
    params = GREEDY.clone()
    params.bad_words = [word]
    assert GREEDY.bad_words is None  # a copy: the shared params are untouched
    banned = llm.generate([ids], params)[0].outputs[0]
    seqs = bad_word_sequences([word], lambda t: tok.encode(t, add_special_tokens=False))
    by_ids = llm.generate([ids], SamplingParams(**{**vars(GREEDY), "bad_words_token_ids": seqs}))[0]
    assert banned.token_ids == by_ids.outputs[0].token_ids != free.token_ids


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
    assert llm.embed([{"prompt": "hi"}], use_tqdm=True)[0].outputs == llm.embed(["hi"])[0].outputs
    assert len(llm.chat(CHAT, GREEDY, use_tqdm=False)) == 1
    with pytest.raises(ValueError, match="takes 'prompt' .* or 'prompt_token_ids'"):
        llm.generate([{"prompt": "x", "mm_processor_kwargs": {}}], GREEDY)
    from PIL import Image

    image = Image.new("RGB", (8, 8))
    with pytest.raises(ValueError, match="takes text only"):  # images need a vision-language model
        llm.generate([{"prompt": "x", "multi_modal_data": {"image": image}}], GREEDY)
