"""vLLM's `--chat-template` (a file or an inline template used instead of the model's own) and
`--chat-template-content-format`: resolving the flag, rendering with it, serving a model that has no
template of its own (one process and `--api-server-count 2`), and the router keying chats as the
replicas render them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.chat_template import ChatTemplates, resolve_chat_template
from engine.config import EngineConfig
from engine.tokenizer import Tokenizer
from kvcache.keys import block_hashes
from router.prompt_keys import TokenKeyer

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def test_flag_value_is_a_file_or_an_inline_template(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert resolve_chat_template(str(path)) == TEMPLATE
    inline = "{{ messages[0].content }}\\n｜é"  # a shell-typed \n is a newline; other characters stay
    assert resolve_chat_template(inline) == "{{ messages[0].content }}\n｜é"
    with pytest.raises(ValueError, match="looks like a file path, but no such file exists"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match=r"chat template \(inline\): .*does not parse"):
        resolve_chat_template("{% for m in messages %}")
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        EngineConfig(chat_template_content_format="parts")
    assert EngineConfig(chat_template=str(path)).chat_template == TEMPLATE


def test_content_formats() -> None:
    probe = "{% for m in messages %}{{ m.content is string }}:{{ m.content | length }}|{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}]
    plain = [{"role": "user", "content": "abcd"}]
    auto = ChatTemplates({"default": probe}, {})
    assert auto.render(parts, add_generation_prompt=False) == "True:5|"  # joined with a newline
    as_string = ChatTemplates({"default": probe}, {}, "string")
    assert as_string.render(parts, add_generation_prompt=False) == "True:5|"
    openai_format = ChatTemplates({"default": probe}, {}, "openai")
    assert openai_format.render(parts, add_generation_prompt=False) == "False:2|"
    assert openai_format.render(plain, add_generation_prompt=False) == "False:1|"  # one text part


@pytest.fixture(scope="module")
def templateless(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama without a chat template of its own."""
    model = tmp_path_factory.mktemp("chat") / "no-template"
    shutil.copytree(tiny_llama, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def chat_server(templateless: Path, template_file: Path, serve_logs: Path, server_process) -> Iterator:
    flags = [
        "--chat-template",
        str(template_file),
        "--trust-request-chat-template",
        "--api-server-count",
        "2",
        "--num-kv-blocks",
        "64",
    ]
    srv = server_process(templateless, flags, serve_logs).start()
    yield srv
    srv.stop()


def test_model_without_template_serves_chats_with_the_flags(chat_server, templateless: Path) -> None:
    assert not Tokenizer.from_dir(templateless).has_chat_template
    want = Tokenizer.from_dir(templateless).encode(
        "<system>be brief\n<user>hello there\n<assistant>", add_special_tokens=False
    )
    for _ in range(4):  # connections spread over both API servers
        got = httpx.post(
            chat_server.url + "/tokenize",
            json={"model": chat_server.model_name, "messages": MESSAGES},
            timeout=30,
        ).json()
        assert got["tokens"] == want
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    answer = client.chat.completions.create(
        model=chat_server.model_name, messages=MESSAGES, max_tokens=3, temperature=0
    )
    assert answer.usage.prompt_tokens == len(want)


def test_router_keys_chats_as_the_replica_renders_them(templateless: Path, template_file: Path) -> None:
    keyer = TokenKeyer.from_dir(str(templateless), 4, resolve_chat_template(str(template_file)))
    ids = Tokenizer.from_dir(templateless).encode(
        "<system>be brief\n<user>hello there\n<assistant>", add_special_tokens=False
    )
    hashes, count = keyer.keys("/v1/chat/completions", {"messages": MESSAGES})
    assert count == len(ids) and hashes == block_hashes(ids, 4)


def test_bad_flag_stops_the_start(
    templateless: Path, tmp_path: Path, serve_logs: Path, server_process
) -> None:
    srv = server_process(templateless, ["--chat-template", str(tmp_path / "nope.jinja")], serve_logs)
    with pytest.raises(RuntimeError, match="looks like a file path, but no such file exists"):
        srv.start(timeout=60)


OWN = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }} {% endfor %}=>"


def test_a_trusted_request_renders_with_its_own_template(chat_server, templateless: Path) -> None:
    want = Tokenizer.from_dir(templateless).encode(
        "[SYSTEM] be brief [USER] hello there =>", add_special_tokens=False
    )
    for body in (
        {"messages": MESSAGES, "chat_template": OWN},
        {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": OWN}},
    ):
        got = httpx.post(
            chat_server.url + "/tokenize", json={"model": chat_server.model_name, **body}, timeout=30
        )
        assert got.json()["tokens"] == want
    chat = {"model": chat_server.model_name, "messages": MESSAGES, "max_tokens": 2, "chat_template": OWN}
    answer = httpx.post(chat_server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert answer["usage"]["prompt_tokens"] == len(want)
    for odd in (["x"], 5):  # a trusting server too: a 400, never a 500
        body = {
            "model": chat_server.model_name,
            "messages": MESSAGES,
            "chat_template_kwargs": {"chat_template": odd},
        }
        assert httpx.post(chat_server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 400
    broken = httpx.post(
        chat_server.url + "/v1/chat/completions",
        json={**chat, "chat_template": "{% for m in messages %}"},
        timeout=60,
    )
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages"
    # The router runs no template of a request's own (it would be code a client makes it run):
    # such a chat gets no cache-aware hint, whichever way it carries the template.
    keyer = TokenKeyer.from_dir(str(templateless), 4, resolve_chat_template(TEMPLATE))
    assert keyer.keys("/v1/chat/completions", {"messages": MESSAGES, "chat_template": OWN}) == ([], 0)
    smuggled = {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": OWN}}
    assert keyer.keys("/v1/chat/completions", smuggled) == ([], 0)
    assert keyer.keys("/v1/chat/completions", {"messages": MESSAGES})[1] == len(
        Tokenizer.from_dir(templateless).encode(
            "<system>be brief\n<user>hello there\n<assistant>", add_special_tokens=False
        )
    )


def test_an_untrusted_request_template_is_refused(server) -> None:
    chat = {"model": server.model_name, "messages": MESSAGES, "max_tokens": 1}
    own = httpx.post(server.url + "/v1/chat/completions", json={**chat, "chat_template": OWN}, timeout=60)
    assert own.status_code == 400 and own.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in own.json()["error"]["message"]
    smuggled = {**chat, "chat_template_kwargs": {"chat_template": OWN}}
    refused = httpx.post(server.url + "/v1/chat/completions", json=smuggled, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
    for odd in (["default"], 5):  # not a template's name: a 400 as any other, never a 500
        body = {**chat, "chat_template_kwargs": {"chat_template": odd}}
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 400
    tokenized = httpx.post(
        server.url + "/tokenize", json={"messages": MESSAGES, "chat_template": OWN}, timeout=60
    )
    assert tokenized.status_code == 400
    # Naming one of the model's own templates needs no trust.
    named = {**chat, "chat_template_kwargs": {"chat_template": "default"}}
    assert httpx.post(server.url + "/v1/chat/completions", json=named, timeout=60).status_code == 200


def test_messages_without_a_template_are_a_400_that_names_the_plain_way(templateless: Path) -> None:
    # The same 400 on chat, the Messages API and the pooling routes: it names no one route.
    from server.chat_protocol import ChatCompletionRequest
    from server.errors import APIError
    from server.prompts import chat_prompt

    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES})
    with pytest.raises(APIError) as refused:
        chat_prompt(req, Tokenizer.from_dir(templateless))
    error = refused.value
    assert (error.status, error.param, error.code) == (400, "messages", "chat_template_missing")
    assert error.message == (
        "This model has no chat template, so its messages cannot be formatted into a prompt; "
        "send a plain prompt instead (prompt to /v1/completions, input to the pooling routes)."
    )
