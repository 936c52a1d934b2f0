"""Real model families' chat templates (``family_chat_templates.py``) render to exactly the token
ids that transformers' ``apply_chat_template(..., tokenize=True)`` gives for the messages as vLLM
hands them to it (text parts joined with newlines, tool-call arguments decoded), across message
shapes: system or not, text parts, tool calls and results in the history, empty arguments, an
assistant's earlier reasoning, ``continue_final_message``, template kwargs. A template that raises
is a 400 carrying its message. The router's ``TokenKeyer`` keys prompts as the replica keeps them
(special tokens, truncation, a Responses request's salts). A live replica: ``test_family_templates_serve.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from family_template_cases import CASES, FAMILIES, TOOLS, USER, family_dir, ferry_ids, hf_ids

from engine.chat_template import ChatTemplates
from engine.tokenizer import Tokenizer
from kvcache.keys import block_hashes
from router.prompt_keys import TokenKeyer
from server.chat_protocol import ChatCompletionRequest
from server.completion_protocol import CompletionRequest
from server.errors import APIError
from server.params import ModelLimits
from server.prompts import chat_prompt, completion_prompts

REFUSED = {
    ("gemma", "system"): "System role not supported",
    ("mixtral", "system"): "Conversation roles must alternate",
    **{
        (family, case): "Conversation roles must alternate"  # a tool turn breaks user/assistant turns
        for family in ("mixtral", "gemma")
        for case in ("tool_history", "empty_arguments", "reasoning_in_history", "ipython_result")
    },
}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Tokenizer, Any, Path]]:
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        path = family_dir(root, family)
        out[family] = (Tokenizer.from_dir(path), PreTrainedTokenizerFast.from_pretrained(str(path)), path)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_templates_render_as_transformers(families, family: str, case: str) -> None:
    tokenizer, hf, _ = families[family]
    body = CASES[case]
    refused = REFUSED.get((family, case))
    if refused is not None:
        with pytest.raises(APIError) as err:
            ferry_ids(tokenizer, body)
        assert err.value.status == 400 and refused in str(err.value)
        return
    if family == "dsr1" and "tool_calls" in json.dumps(body):
        # DeepSeek's template concatenates the arguments as text: transformers renders the
        # client's JSON text (decoded objects make it raise), and so must ferry.
        want = hf_ids(hf, body, decode_arguments=False) if case != "empty_arguments" else None
        got = ferry_ids(tokenizer, body)
        text = tokenizer.decode(got, skip_special_tokens=False)
        if want is not None:
            assert got == want
        else:
            assert "get_weather\n```json\n{}\n```" in text
        return
    want = hf_ids(hf, body)
    got = ferry_ids(tokenizer, body)
    assert got == want
    bos = FAMILIES[family][1]
    if bos is not None:  # the template's own BOS only: none added by the tokenizer
        assert got.count(tokenizer.backend.token_to_id(bos)) == 1


def test_reasoning_in_history_reaches_the_template(families) -> None:
    """An assistant turn's reasoning sent back (``reasoning_content`` or ``reasoning``) is written
    where Qwen3's template puts it, not an empty think block."""
    tokenizer, _, _ = families["qwen3"]
    for case in ("reasoning_in_history", "reasoning_field"):
        text = tokenizer.decode(ferry_ids(tokenizer, CASES[case]), skip_special_tokens=False)
        thought = (
            CASES[case]["messages"][1].get("reasoning_content") or CASES[case]["messages"][1]["reasoning"]
        )
        assert f"<|im_start|>assistant\n<think>\n{thought}\n</think>\n\n" in text


def test_llama31_writes_a_custom_ipython_turn(families) -> None:
    """A message of role ``ipython`` (a role of Llama 3.1's template, not OpenAI's) reaches the
    template as written, which writes it as a tool result turn; the router's keyer renders it too."""
    tokenizer, _, path = families["llama31"]
    body = CASES["ipython_result"]
    got = ferry_ids(tokenizer, body)
    text = tokenizer.decode(got, skip_special_tokens=False)
    assert text.endswith(
        # Llama 3.1 writes a tool result as JSON (``| tojson``), a string too.
        '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temp\\": \\"22C\\"}"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert TokenKeyer.from_dir(str(path), 16).token_ids("/v1/chat/completions", body) == got


def test_add_special_tokens_adds_the_tokenizers_bos_on_top(families) -> None:
    """vLLM's chat ``add_special_tokens``: off by default (the template's BOS only), on it adds the
    tokenizer's BOS as well; the router's keyer renders the same."""
    tokenizer, hf, path = families["llama31"]
    bos = tokenizer.bos_token_id
    keyer = TokenKeyer.from_dir(str(path), 16)
    text = hf.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    for add, want in ((False, hf.encode(text, add_special_tokens=False)), (True, hf.encode(text))):
        body = {"messages": [USER], "add_special_tokens": add}
        got = ferry_ids(tokenizer, body)
        assert got == want and got[: 2 if add else 1].count(bos) == (2 if add else 1)
        assert keyer.token_ids("/v1/chat/completions", body) == want


def test_completions_of_a_rendered_chat_keep_its_one_bos(families) -> None:
    """A client that renders the chat template itself sends the text to /v1/completions with
    vLLM's ``add_special_tokens: false``: the prompt keeps the template's BOS only (by default the
    tokenizer adds its own, as vLLM does); the router's keyer encodes alike."""
    tokenizer, hf, path = families["llama31"]
    keyer = TokenKeyer.from_dir(str(path), 16)
    limits = ModelLimits(vocab_size=tokenizer.vocab_size, max_model_len=4096, max_logprobs=20, max_n=8)
    text = hf.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    for extra, want in (
        ({"add_special_tokens": False}, hf.encode(text, add_special_tokens=False)),
        ({}, hf.encode(text)),
    ):
        body = {"prompt": text, **extra}
        request = CompletionRequest.model_validate({"model": "m", **body})
        assert completion_prompts(request, tokenizer, limits)[0].token_ids == want
        assert keyer.token_ids("/v1/completions", body) == want
    assert want[:2] == [tokenizer.bos_token_id] * 2 and want[1:] == hf.encode(text, add_special_tokens=False)


def test_tools_even_none_pick_the_tool_use_template(families) -> None:
    """A model's named ``tool_use`` template serves any request that sends ``tools``, an empty list
    too, as transformers picks it."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(families["qwen25"][2]))
    templates = {"default": "D", "tool_use": "T{{ tools | length }}"}
    hf.chat_template = templates
    ours = ChatTemplates(templates, {})
    for tools in (None, [], TOOLS):
        want = hf.apply_chat_template([USER], tools=tools, tokenize=False, add_generation_prompt=False)
        assert ours.render([USER], tools=tools, add_generation_prompt=False) == want
    assert want == "T1"


def test_router_keys_a_truncated_prompt_as_the_replica_keeps_it(families) -> None:
    """``truncate_prompt_tokens``: the replica keeps the prompt's last N tokens, and the router's
    block hashes are those of the kept tokens (chat and completions)."""
    tokenizer, _, path = families["qwen3"]
    keyer = TokenKeyer.from_dir(str(path), 4)
    limits = ModelLimits(vocab_size=tokenizer.vocab_size, max_model_len=4096, max_logprobs=20, max_n=8)
    chat = {**CASES["tool_history"], "truncate_prompt_tokens": 10}
    kept = chat_prompt(ChatCompletionRequest.model_validate({"model": "m", **chat}), tokenizer, limits=limits)
    assert len(kept) == 10
    assert keyer.keys("/v1/chat/completions", chat) == (block_hashes(kept, 4), 10)
    completion = {"prompt": "def f(x):\n    return x + 1\n" * 3, "truncate_prompt_tokens": 9}
    request = CompletionRequest.model_validate({"model": "m", **completion})
    kept = completion_prompts(request, tokenizer, limits)[0].token_ids
    assert len(kept) == 9
    assert keyer.keys("/v1/completions", completion) == (block_hashes(kept, 4), 9)


def test_router_salts_a_responses_prompt_as_the_replica_does(families) -> None:
    """A Responses request's ``cache_salt`` and adapter (its ``model``) salt its block hashes on
    the replica, as a chat request's do: the router keys it the same way."""
    tokenizer, _, path = families["qwen3"]
    keyer = TokenKeyer.from_dir(str(path), 4)
    keyer.model_extra = lambda model: b"adapter:" + str(model).encode()
    messages = [{"role": "system", "content": "Be brief."}, USER]
    responses = {"model": "lora-a", "instructions": "Be brief.", "input": USER["content"], "cache_salt": "s1"}
    chat = {"model": "lora-a", "messages": messages, "cache_salt": "s1"}
    hashes, count = keyer.keys("/v1/responses", responses)
    assert count > 0 and (hashes, count) == keyer.keys("/v1/chat/completions", chat)
    assert hashes != keyer.keys("/v1/chat/completions", {"messages": messages})[0]
