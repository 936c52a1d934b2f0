"""engine.tokenizer against transformers' PreTrainedTokenizerFast on the tiny checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizer_helpers import build_metaspace_dir

from engine.tokenizer import ChatTemplateError, Tokenizer, flatten_content_parts, template_iterates_content

TEXTS = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "def f(x):\n    return x + 1\n\n",
    "héllo wörld — ünïcödé ✓ 😀 中文",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text with <|endoftext|> inside and <|im_end|>",
    "\t\ttabs\r\nand CRLF",
    "ｆｕｌｌ ｗｉｄｔｈ and 🤖🦀 emoji",
]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": " part two"}],
        }
    ],
    [{"role": "user", "content": "ünïcödé 😀"}, {"role": "assistant", "content": None, "name": "x"}],
]


def _hf_chat(hf, messages: list[dict], **kwargs):  # noqa: ANN001, ANN202
    """transformers' ``apply_chat_template``, skipping where this release cannot be the reference:
    5.17 fails on (or prints "None" for) a message whose content is None, which 5.25 and ferry
    render as empty."""
    import transformers

    missing = any(m.get("content", "") is None for m in messages)
    try:
        out = hf.apply_chat_template(messages, **kwargs)
    except TypeError:
        if not missing:
            raise
        pytest.skip(f"transformers {transformers.__version__} cannot render a message without content")
    if missing and kwargs.get("tokenize") is False and "None" in out:
        pytest.skip(f"transformers {transformers.__version__} renders a missing content as 'None'")
    return out


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def pair(model_dir: Path):
    from transformers import PreTrainedTokenizerFast

    return Tokenizer.from_dir(model_dir), PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def test_import_is_torch_free() -> None:
    code = (
        "import sys, engine.tokenizer, engine.detokenizer;"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vocab_and_special_ids_match_hf(pair) -> None:
    ours, hf = pair
    assert ours.vocab_size == len(hf) == 1000
    # transformers lists only the named ones (eos, pad); we list every special added token, which is
    # what decode(skip_special_tokens=True) drops in both.
    assert set(hf.all_special_ids) == {0, 2}
    assert ours.all_special_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special} == {0, 1, 2}
    assert ours.eos_token_ids == [hf.eos_token_id] == [2]
    assert ours.bos_token_id is None and hf.bos_token_id is None
    assert ours.has_chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(pair, text: str) -> None:
    ours, hf = pair
    for add in (True, False):
        ids = ours.encode(text, add_special_tokens=add)
        assert ids == hf.encode(text, add_special_tokens=add)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_out_of_vocabulary_ids(pair) -> None:
    ours, hf = pair
    # Past the vocabulary (padded embedding rows): no text, as in transformers.
    assert ours.decode([5, 1000, 6]) == hf.decode([5, 1000, 6]) == ours.decode([5, 6])
    assert ours.convert_ids_to_tokens([1000]) == [""]
    for bad in ([-1], [2**40]):
        with pytest.raises(ValueError, match="out of range"):
            ours.decode(bad)
        with pytest.raises(ValueError, match="out of range"):
            ours.convert_ids_to_tokens(bad)
    with pytest.raises(ValueError, match="token id 1000 is out of range: the vocabulary has 1000 tokens"):
        ours.check_ids([5, 1000])
    assert ours.check_ids((5, 999)) == [5, 999] and ours.decode([]) == ""


def test_special_tokens_encode_as_single_ids(pair) -> None:
    ours, _ = pair
    assert ours.encode("<|im_start|>x<|im_end|>")[0] == 1
    assert ours.encode("<|im_start|>x<|im_end|>")[-1] == 2
    assert ours.decode([1, 2, 0]) == ""


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(pair, conv: int, add_generation_prompt: bool) -> None:
    ours, hf = pair
    messages = CONVERSATIONS[conv]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == _hf_chat(hf, messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = ours.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    expected = _hf_chat(hf, messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert ids == list(expected)


def test_chat_template_exact_text(tiny_llama: Path) -> None:
    tok = Tokenizer.from_dir(tiny_llama)
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "U"}])
    assert ids[0] == 1 and ids.count(2) == 1


def test_token_text_marks_partial_utf8_bytes(tiny_llama: Path) -> None:
    tok = Tokenizer.from_dir(tiny_llama)
    ids = tok.encode("é😀")
    texts = [tok.token_text(i) for i in ids]
    assert all(t.startswith("bytes:\\x") for t in texts)
    raw = b"".join(tok.token_bytes(i) for i in ids)
    assert raw == "é😀".encode()
    assert "".join(t.removeprefix("bytes:") for t in texts) == "".join(f"\\x{b:02x}" for b in raw)
    assert tok.token_text(2) == "<|im_end|>"
    word = tok.encode(" return", add_special_tokens=False)
    assert "".join(tok.token_text(i) for i in word) == " return"


def test_sentencepiece_style_tokenizer_matches_hf(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    d = build_metaspace_dir(tmp_path / "ms")
    ours, hf = Tokenizer.from_dir(d), PreTrainedTokenizerFast.from_pretrained(str(d))
    assert ours.bos_token_id == 1 and ours.eos_token_ids == [2] and ours.all_special_ids == {0, 1, 2}
    assert ours.vocab_size == len(hf)
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    ids = ours.encode("Hello world é")
    assert ids[0] == 1
    # "▁" is a space even as the first token shown alone; byte-fallback pieces are shown as bytes.
    texts = [ours.token_text(i) for i in ids]
    assert texts[0] == "<s>" and texts[1] == " "
    assert "".join(texts[1:-2]) == " Hello world "
    assert texts[-2:] == ["bytes:\\xc3", "bytes:\\xa9"]
    assert b"".join(ours.token_bytes(i) for i in ids[1:]) == " Hello world é".encode()


# -- variations of tokenizer_config.json / template files ------------------------------------------


def _variant(
    src: Path, dst: Path, config_update: dict, drop: tuple[str, ...] = (), files: dict | None = None
) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(config_update)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, content in (files or {}).items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return dst


def test_bos_insertion_follows_tokenizer_json(tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    # tokenizer.json has a post-processor: add_bos_token in the config is ignored, as in transformers 5.
    d = _variant(tiny_llama, tmp_path / "bos", {"bos_token": "<|endoftext|>", "add_bos_token": True})
    ours, hf = Tokenizer.from_dir(d), PreTrainedTokenizerFast.from_pretrained(str(d))
    assert ours.bos_token_id == 0
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)
    # A post-processor that adds BOS (Llama-style tokenizer.json) is honoured.
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (d / "tokenizer.json").write_text(json.dumps(spec))
    ours, hf = Tokenizer.from_dir(d), PreTrainedTokenizerFast.from_pretrained(str(d))
    for text in TEXTS[1:]:
        assert ours.encode(text) == hf.encode(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.encode("hi")[0] == 0 and ours.encode("hi", add_special_tokens=False)[0] != 0
    # No post-processor at all: the config's add_bos_token decides.
    spec["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(spec))
    assert Tokenizer.from_dir(d).encode("hi")[0] == 0
    (d / "tokenizer_config.json").write_text(
        json.dumps({**json.loads((d / "tokenizer_config.json").read_text()), "add_bos_token": False})
    )
    assert Tokenizer.from_dir(d).encode("hi")[0] != 0
    # The BOS string is visible to the template.
    d2 = _variant(
        tiny_llama,
        tmp_path / "bos2",
        {"bos_token": "<|endoftext|>", "chat_template": "{{ bos_token }}X"},
        files={"chat_template.jinja": "{{ bos_token }}{{ eos_token }}"},
    )
    assert Tokenizer.from_dir(d2).apply_chat_template([]) == "<|endoftext|><|im_end|>"


def test_new_special_token_from_config_is_added(tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    d = _variant(tiny_llama, tmp_path / "extra", {"additional_special_tokens": ["<|tool|>"]})
    ours, hf = Tokenizer.from_dir(d), PreTrainedTokenizerFast.from_pretrained(str(d))
    assert ours.vocab_size == len(hf) == 1001
    assert ours.encode("a<|tool|>b") == hf.encode("a<|tool|>b")
    assert 1000 in ours.all_special_ids
    assert ours.decode(ours.encode("a<|tool|>b")) == "ab"


def test_eos_ids_union_with_generation_config(tiny_llama: Path, tmp_path: Path) -> None:
    d = _variant(
        tiny_llama,
        tmp_path / "eos",
        {},
        files={"generation_config.json": {"eos_token_id": [2, 0]}, "config.json": {"eos_token_id": 1}},
    )
    assert Tokenizer.from_dir(d).eos_token_ids == [2, 0, 1]


def test_named_templates_and_file_precedence(tiny_llama: Path, tmp_path: Path) -> None:
    named = [
        {"name": "default", "template": "D{{ messages|length }}"},
        {"name": "tool_use", "template": "T{{ tools|tojson }}"},
    ]
    d = _variant(tiny_llama, tmp_path / "named", {"chat_template": named})
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template_names == ["default", "tool_use"]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    tools = [{"type": "function", "function": {"name": "f<&>", "description": "é"}}]
    assert (
        tok.apply_chat_template([], tools=tools)
        == 'T[{"type": "function", "function": {"name": "f<&>", "description": "é"}}]'
    )
    assert tok.apply_chat_template([], chat_template="default") == "D0"
    with pytest.raises(ChatTemplateError, match="no chat template named 'nope'"):
        tok.apply_chat_template([], chat_template="nope")
    # A chat_template.jinja file replaces what tokenizer_config.json says (as in transformers).
    (d / "chat_template.jinja").write_text("F{{ add_generation_prompt }}")
    assert Tokenizer.from_dir(d).apply_chat_template([], add_generation_prompt=False) == "FFalse"


def test_template_kwargs_reach_the_template(tiny_llama: Path, tmp_path: Path) -> None:
    d = _variant(
        tiny_llama,
        tmp_path / "kw",
        {"chat_template": "{{ enable_thinking }}|{{ messages[0]['reasoning_content'] }}"},
        drop=(),
        files={},
    )
    (d / "chat_template.jinja").unlink(missing_ok=True)
    tok = Tokenizer.from_dir(d)
    out = tok.apply_chat_template(
        [{"role": "assistant", "content": "a", "reasoning": "r"}], enable_thinking=False
    )
    assert out == "False|r"


def test_a_turns_reasoning_reaches_the_template_under_every_name(tiny_llama: Path, tmp_path: Path) -> None:
    # vLLM renamed reasoning_content to reasoning: a client may send either, a template may read
    # either (Qwen3's reads reasoning_content); the prompt is the same whichever pair meets.
    template = (
        "{% for m in messages %}{{ m.reasoning }}|{{ m.reasoning_content }}|{{ m.thinking }};{% endfor %}"
    )
    d = _variant(tiny_llama, tmp_path / "names", {"chat_template": template}, drop=(), files={})
    (d / "chat_template.jinja").unlink(missing_ok=True)
    tok = Tokenizer.from_dir(d)
    for name in ("reasoning", "reasoning_content"):
        out = tok.apply_chat_template([{"role": "assistant", "content": "a", name: "r"}])
        assert out == "r|r|r;", name


def test_no_template_is_a_clear_error(tiny_llama: Path, tmp_path: Path) -> None:
    d = _variant(tiny_llama, tmp_path / "none", {}, drop=("chat_template",))
    tok = Tokenizer.from_dir(d)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template; use /v1/completions"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(ChatTemplateError("x"), ValueError)


def test_template_failures_become_chat_template_errors(tiny_llama: Path, tmp_path: Path) -> None:
    raising = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    tok = Tokenizer.from_dir(_variant(tiny_llama, tmp_path / "r", {"chat_template": raising}))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        Tokenizer.from_dir(
            _variant(tiny_llama, tmp_path / "s", {"chat_template": "{% for %}"})
        ).apply_chat_template([])
    crashing = "{{ messages[0]['content'] + 1 }}"
    with pytest.raises(ChatTemplateError, match="chat template"):
        Tokenizer.from_dir(
            _variant(tiny_llama, tmp_path / "c", {"chat_template": crashing})
        ).apply_chat_template([{"role": "user", "content": "x"}])
    sandbox = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_dir(
            _variant(tiny_llama, tmp_path / "x", {"chat_template": sandbox})
        ).apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="must be an object"):
        tok.apply_chat_template(["not a message"])


def test_string_templates_get_flattened_parts(tiny_llama: Path, tmp_path: Path) -> None:
    string_tpl = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
    assert not template_iterates_content(string_tpl)
    assert template_iterates_content(
        "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"
    )
    aliased = (
        "{% for m in messages %}{% set c = m['content'] %}{% for p in c | list %}{% endfor %}{% endfor %}"
    )
    assert template_iterates_content(aliased)
    assert not template_iterates_content(
        "{% for m in messages %}{% set c = m['role'] %}{% for x in c %}{% endfor %}{% endfor %}"
    )
    tok = Tokenizer.from_dir(_variant(tiny_llama, tmp_path / "str", {"chat_template": string_tpl}))
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == "[user:a\nb]"
    with pytest.raises(ChatTemplateError, match="'image_url' is not supported"):
        tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )
    # The ChatML template loops over parts itself, so it gets them unflattened (as transformers does).
    chatml = Tokenizer.from_dir(tiny_llama)
    assert chatml.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=False) == (
        "<|im_start|>user\nab<|im_end|>\n"
    )
    assert flatten_content_parts([{"role": "user", "content": parts}]) == [
        {"role": "user", "content": "a\nb"}
    ]


def test_continue_final_message_leaves_the_last_message_open(tiny_llama: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    ours, hf = Tokenizer.from_dir(tiny_llama), PreTrainedTokenizerFast.from_pretrained(str(tiny_llama))
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    text = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,"
    assert text == hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ours.apply_chat_template(parts, add_generation_prompt=False, continue_final_message=True) == (
        "<|im_start|>assistant\nab"
    )
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        ours.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="at least one message"):
        ours.apply_chat_template([], add_generation_prompt=False, continue_final_message=True)


# A template in the style of real ones: block tags on their own indented lines (trim_blocks and
# lstrip_blocks matter), namespace(), loop.last, tools through tojson, raise_exception, bos_token.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% if messages and messages[0]['role'] == 'system' %}
    {% set ns.system = messages[0]['content'] %}
    {% set messages = messages[1:] %}
{% endif %}
{% if tools %}
<tools>
    {% for tool in tools %}
{{ tool | tojson }}
    {% endfor %}
</tools>
{% endif %}
{% if ns.system %}[SYS] {{ ns.system | trim }}
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    <{{ message['role'] }}>{{ message['content'] }}{% if not loop.last %}{{ eos_token }}{% endif %}

{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("with_tools", [False, True])
def test_rich_template_matches_hf(tiny_qwen2: Path, tmp_path: Path, conv: int, with_tools: bool) -> None:
    from transformers import PreTrainedTokenizerFast

    d = _variant(
        tiny_qwen2, tmp_path / "rich", {"chat_template": RICH_TEMPLATE, "bos_token": "<|endoftext|>"}
    )
    (d / "chat_template.jinja").unlink(missing_ok=True)
    ours, hf = Tokenizer.from_dir(d), PreTrainedTokenizerFast.from_pretrained(str(d))
    tools = [
        {"type": "function", "function": {"name": "get<weather>", "parameters": {"city": "Zürich & co"}}}
    ]
    messages = CONVERSATIONS[conv]
    if not template_iterates_content(RICH_TEMPLATE):
        messages = flatten_content_parts(messages)  # what we hand such templates; HF passes lists as is
    kwargs = {"tools": tools} if with_tools else {}
    text = ours.apply_chat_template(CONVERSATIONS[conv], **kwargs)
    assert text == _hf_chat(hf, messages, add_generation_prompt=True, tokenize=False, **kwargs)
    assert text.startswith("<|endoftext|>") and text.endswith("<assistant>")
    assert ('{"name": "get<weather>"' in text) == with_tools
    with pytest.raises(ChatTemplateError, match="unknown role robot"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}])
