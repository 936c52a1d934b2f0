"""`vllm serve` flags about chats, logging and the HTTP server, on one real `ferry serve` process
(two API server processes) whose model is a hub id resolved offline from a local Hugging Face cache:
``--revision`` / ``--tokenizer-revision`` / ``--download-dir``, ``--default-chat-template-kwargs``
and ``--exclude-tools-when-tool-choice-none`` (and the router rendering the same prompt with the
same flags), ``--response-role``, ``--enable-tokenizer-info-endpoint``, ``--enable-log-outputs``,
``--disable-uvicorn-access-log``, ``--h11-max-incomplete-event-size`` and the compatibility flags'
notes; then the values ferry refuses, each stopping the start with one line."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router.prompt_keys import TokenKeyer
from server.chat_defaults import ChatDefaults

TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %};\n{% endif %}"
    "{% if mood is defined %}mood: {{ mood }}\n{% endif %}"
    "{% if add_generation_prompt %}bot:{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
HELLO = [{"role": "user", "content": "hello there"}]
COMMITS = {"main": "a" * 40, "v1": "b" * 40}


@pytest.fixture(scope="module")
def hub_cache(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face cache holding two revisions of ``ferry-test/tiny``: main (tiny_llama) and v1
    (its context cut to 96); each tokenizer_config.json names its revision."""
    root = tmp_path_factory.mktemp("hub")
    repo = root / "models--ferry-test--tiny"
    (repo / "refs").mkdir(parents=True)
    for name, commit in COMMITS.items():
        snapshot = repo / "snapshots" / commit
        shutil.copytree(tiny_llama, snapshot)
        _update_json(snapshot / "tokenizer_config.json", ferry_snapshot=name)
        if name == "v1":
            _update_json(snapshot / "config.json", max_position_embeddings=96)
        (repo / "refs" / name).write_text(commit)
    return root


def _update_json(path: Path, **values: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


@pytest.fixture(scope="module")
def chat_server(hub_cache: Path, serve_logs: Path, server_process) -> Iterator:
    flags = [
        "--revision", "v1", "--tokenizer-revision", "main", "--download-dir", str(hub_cache),
        "--served-model-name", "tiny", "--chat-template", TEMPLATE,
        "--default-chat-template-kwargs", '{"mood": "calm"}', "--exclude-tools-when-tool-choice-none",
        "--response-role", "bot", "--enable-tokenizer-info-endpoint", "--stream-interval", "3",
        "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "5",
        "--log-level", "debug", "--disable-uvicorn-access-log", "--h11-max-incomplete-event-size", "4096",
        "--api-server-count", "2",
        # Accepted, each logged with what ferry does.
        "-O3", "--preemption-mode", "recompute", "--logprobs-mode", "raw_logprobs", "--cpu-offload-gb", "0",
        "--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": true}',
        "--enable-request-id-headers", "--max-num-partial-prefills", "2", "--code-revision", "v1",
        "--mm-processor-cache-gb", "0",  # a zero is given too (vLLM's way to turn its cache off)
    ]  # fmt: skip
    # The hub id (not a directory): resolved from the cache at the revisions asked, no network.
    srv = server_process(Path("ferry-test/tiny"), flags, serve_logs)
    srv.start(env={"HF_HUB_OFFLINE": "1"})
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield srv, client
    srv.stop()


def test_revisions_pick_the_snapshots_and_tokenizer_info_shows_the_tokenizer(chat_server, server) -> None:
    srv, client = chat_server
    # The model's config is v1's (--revision), the tokenizer main's (--tokenizer-revision).
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 96
    info = client.get("/tokenizer_info")
    assert info.status_code == 200, info.text
    info = info.json()
    assert info["ferry_snapshot"] == "main" and info["chat_template"] == TEMPLATE
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert httpx.get(server.url + "/tokenizer_info", timeout=30).status_code == 404  # off by default


def _rendered(client: httpx.Client, **body: object) -> tuple[list[int], str]:
    ids = client.post("/tokenize", json={"messages": HELLO, **body}).json()["tokens"]
    return ids, client.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_default_template_kwargs_under_the_requests_own(chat_server, hub_cache: Path) -> None:
    _, client = chat_server
    ids, text = _rendered(client)
    assert text == "user: hello there\nmood: calm\nbot:"
    _, text = _rendered(client, chat_template_kwargs={"mood": "glad"})  # the request's value wins
    assert text == "user: hello there\nmood: glad\nbot:"
    tool_ids, text = _rendered(client, tools=TOOLS)  # /tokenize has no tool_choice: tools shown
    assert text == "user: hello there\ntools: lookup;\nmood: calm\nbot:"
    # A chat's prompt: tool_choice "none" renders without the tools (--exclude-tools-when-tool-choice-none).
    chat = {"model": "tiny", "messages": HELLO, "max_tokens": 1}
    usage = [
        client.post("/v1/chat/completions", json={**chat, **extra}).json()["usage"]["prompt_tokens"]
        for extra in (
            {},
            {"tools": TOOLS, "tool_choice": "none"},
            {"tools": TOOLS, "tool_choice": "required"},
        )
    ]
    assert usage == [len(ids), len(ids), len(tool_ids)]
    # The router renders the same prompt given the replicas' flags, and another without them.
    tokenizer_dir = hub_cache / "models--ferry-test--tiny" / "snapshots" / COMMITS["main"]
    same = TokenKeyer.from_dir(str(tokenizer_dir), 16, TEMPLATE, chat=ChatDefaults({"mood": "calm"}, True))
    body = {"messages": HELLO, "tools": TOOLS, "tool_choice": "none"}
    assert same.token_ids("/v1/chat/completions", body) == ids
    assert same.token_ids("/v1/chat/completions", {**body, "tool_choice": "auto"}) == tool_ids
    assert (
        TokenKeyer.from_dir(str(tokenizer_dir), 16, TEMPLATE).token_ids("/v1/chat/completions", body) != ids
    )


def test_response_role(chat_server) -> None:
    _, client = chat_server
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 2}
    answer = client.post("/v1/chat/completions", json=body).json()
    assert answer["choices"][0]["message"]["role"] == "bot"
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
    assert first["choices"][0]["delta"] == {"role": "bot", "content": ""}
    # Without a new turn, the answer continues the last message, in its role (as vLLM).
    answer = client.post("/v1/chat/completions", json={**body, "add_generation_prompt": False}).json()
    assert answer["choices"][0]["message"]["role"] == "user"


def test_stream_interval_flag_is_the_floor(chat_server) -> None:
    """``--stream-interval 3``: every chunk of a stream between its first and last holds 3 tokens or
    more; a request's ``stream_interval`` below it is raised to it, one above it is taken."""
    _, client = chat_server
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 13, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "return_token_ids": True}
    streams = {}
    for asked in (None, 1, 5):
        extra = {} if asked is None else {"stream_interval": asked}
        with client.stream("POST", "/v1/chat/completions", json={**body, **extra}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        parts = [c["choices"][0].get("token_ids") for c in chunks if c["choices"]]
        streams[asked] = [p for p in parts if p]
    assert [t for p in streams[5] for t in p] == [t for p in streams[None] for t in p]
    for asked, floor in ((None, 3), (1, 3), (5, 5)):
        sizes = [len(p) for p in streams[asked]]
        assert sum(sizes) == 13 and all(n >= floor for n in sizes[1:-1]), (asked, sizes)


def test_outputs_are_logged_cut_to_max_log_len(chat_server) -> None:
    srv, client = chat_server
    body = {
        "model": "tiny",
        "prompt": "once upon",
        "max_tokens": 7,
        "temperature": 0,
        "return_token_ids": True,
    }
    answer = client.post("/v1/completions", json=body, headers={"X-Request-Id": "whole-1"}).json()["choices"][
        0
    ]
    with client.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers={"X-Request-Id": "streamed-1"}
    ) as r:
        r.read()
    log = srv.log_path.read_text()
    for rid in ("whole-1", "streamed-1"):
        line = next(x for x in log.splitlines() if f"Generated response {rid}" in x)
        assert (
            f"output: {answer['text'][:5]!r}, output_token_ids: {answer['token_ids'][:5]}, finish_reason: length"
        ) in line, line


def test_http_limits_access_log_and_compat_notes(chat_server) -> None:
    srv, client = chat_server
    assert client.get("/health", headers={"X-Big": "x" * 1000}).status_code == 200
    # A request head still arriving past 4096 bytes is refused, not buffered on (server/http_limits.py).
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * 5000)
        assert sock.recv(100).startswith(b"HTTP/1.1 431 ")
    log = srv.log_path.read_text()
    assert 'HTTP/1.1" 200' not in log  # --log-level debug writes access lines unless disabled
    for note in (
        "--compilation-config is accepted for vLLM compatibility",
        "--enable-request-id-headers is accepted for vLLM compatibility",
        "--max-num-partial-prefills is accepted for vLLM compatibility",
        "--code-revision is accepted for vLLM compatibility",
        "--mm-processor-cache-gb is accepted for vLLM compatibility and changes nothing: the last 32 images",
        "--preemption-mode recompute is what ferry does",
        "--cpu-offload-gb 0.0 is what ferry does",
        "structured-output backend guidance: ferry's structured outputs are xgrammar's",
        "structured-output options disable_any_whitespace: accepted for vLLM compatibility, ignored",
    ):
        assert note in log, note


def test_values_ferry_cannot_honour_stop_the_start(capsys) -> None:
    from ferry.cli import main

    refused = {
        ("--preemption-mode", "swap"): "--preemption-mode swap: ferry never swaps KV blocks",
        ("--cpu-offload-gb", "4"): "--cpu-offload-gb 4.0: ferry keeps every weight on the device",
        ("--kv-transfer-config", '{"kv_connector": "NixlConnector"}'): "use --kv-tier URL and --role",
        ("--collect-detailed-traces", "model"): "--collect-detailed-traces needs --otlp-traces-endpoint",
        (
            "--otlp-traces-endpoint",
            "http://127.0.0.1:4317",
            "--collect-detailed-traces",
            "model,gpu",
        ): "--collect-detailed-traces: 'gpu' is not one of model, worker, all",
        ("--logits-processors", "my.Proc"): "ferry loads no logits-processor plugins",
        ("--headless",): "--headless: a ferry replica always serves its own API",
        ("--skip-tokenizer-init",): "--skip-tokenizer-init: ferry needs the tokenizer",
        ("-tp", "2"): "--tensor-parallel-size 2: a ferry replica runs on one device",
        ("--guided-decoding-backend", "nope:no-fallback"): "structured-output backend 'nope' is not one of",
        ("--structured-outputs-config", "xgrammar"): "--structured-outputs-config must be a JSON object",
        ("--default-chat-template-kwargs", "[1]"): "--default-chat-template-kwargs must be a JSON object",
        (
            "--default-chat-template-kwargs",
            '{"add_generation_prompt": false}',
        ): "must not set add_generation_prompt",
        ("--h11-max-incomplete-event-size", "0"): "--h11-max-incomplete-event-size must be positive",
        ("--header-timeout", "nan"): "--header-timeout must be positive, got nan",
        ("--stream-interval", "0"): "--stream-interval must be at least 1, got 0",
    }
    for flags, message in refused.items():  # before any model is read
        assert main(["serve", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ferry serve: error: ") and message in err and err.count("\n") == 1, err
