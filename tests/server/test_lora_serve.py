"""LoRA adapters over HTTP, as vLLM serves them: ``--enable-lora --lora-modules``, the adapter named
as ``model`` (same tokens as the offline engine with that adapter; answers carry its name), listed
in ``/v1/models`` with its base as ``parent``, loaded and unloaded at run time, with
``--api-server-count`` too."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.demo import build_lora_adapter
from engine.lora import adapter_weights_id
from server.lora import parse_lora_modules
from server.lora_resolver import resolver_dir as env_resolver_dir
from tests.server.conftest import metric_value
from tests.server.test_api_servers import _serve, call, connection_per_api_server

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: build_lora_adapter(root / name, tiny_llama, seed=seed, rank=8, alpha=32)
        for name, seed in (("a", 1), ("b", 2), ("c", 4))
    }


@pytest.fixture(scope="module")
def resolver_dir(tmp_path_factory, tiny_llama: Path, adapters) -> Path:
    """--lora-resolver-dir's directory: adapters "d" (c's weights: seed 4) and "e" (seed 7), links
    inside the directory to "d" (one name per route that resolves), a rank-32 adapter "big" (over
    --max-lora-rank 16), an entry with no adapter, and a link out of the directory to adapter a."""
    root = tmp_path_factory.mktemp("resolver")
    build_lora_adapter(root / "d", tiny_llama, seed=4, rank=8, alpha=32)
    build_lora_adapter(root / "e", tiny_llama, seed=7, rank=8, alpha=32)
    for name in RESOLVED_ROUTES:
        (root / name).symlink_to(root / "d")
    build_lora_adapter(root / "big", tiny_llama, seed=5, rank=32)
    (root / "empty").mkdir()
    (root / "out").symlink_to(adapters["a"])
    return root


RESOLVED_ROUTES = ("via_chat", "via_responses", "via_messages", "via_embeddings", "via_tokenize")


@pytest.fixture(scope="module")
def lora_server(tiny_llama: Path, adapters, resolver_dir, serve_logs: Path, server_process) -> Iterator:
    # An empty entry is skipped, and a base_model_name the base is not served by is not b's parent (vLLM's)
    b = {"name": "b", "path": str(adapters["b"]), "base_model_name": "not-served"}
    modules = [f"a={adapters['a']}", "", json.dumps(b)]
    flags = ["--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating", "--lora-modules", *modules]
    flags += ["--fully-sharded-loras", "--lora-dtype", "bfloat16"]  # vLLM's: accepted, logged
    flags += ["--lora-resolver-dir", str(resolver_dir)]
    srv = server_process(tiny_llama, [*flags, "--num-kv-blocks", "256"], serve_logs).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama: Path, adapters) -> dict[str | None, list[int]]:
    """The offline engine's greedy tokens for PROMPT, per adapter (None: the base model)."""
    llm = LLM(str(tiny_llama), enable_lora=True, num_kv_blocks=64, num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = {}
    for i, name in enumerate((None, "a", "b", "c")):
        lora = LoRARequest(name, i, str(adapters[name])) if name else None
        out[name] = llm.generate([PROMPT], params, lora_request=lora)[0].outputs[0].token_ids
    assert len({tuple(v) for v in out.values()}) == 4  # each adapter says something else
    return out


def _token_ids(client: openai.OpenAI, model: str) -> tuple[str, list[int]]:
    r = client.completions.create(model=model, prompt=PROMPT, extra_body={**GREEDY, "return_token_ids": True})
    return r.model, r.choices[0].token_ids


def test_models_lists_adapters_with_their_base(lora_server, client, adapters) -> None:
    cards = {m.id: m for m in client.models.list().data}
    base = lora_server.model_name
    assert set(cards) == {base, "a", "b"}
    assert cards[base].parent is None
    for name in ("a", "b"):
        card = cards[name].model_dump()
        assert card["parent"] == base and card["root"] == str(adapters[name])
        assert card["lora_weights_id"] == adapter_weights_id(adapters[name])
        assert card["lora_preloaded"] is True  # from --lora-modules: routers do not adopt it
        assert card["lora_resolved"] is False  # not the resolver directory's entry of its name
    assert cards[base].model_dump()["lora_preloaded"] is None


def test_requests_run_the_named_adapter(lora_server, client, offline) -> None:
    for name in ("a", "b"):
        model, ids = _token_ids(client, name)
        assert (model, ids) == (name, offline[name])
    assert _token_ids(client, lora_server.model_name) == (lora_server.model_name, offline[None])
    chat = client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "b"
    chunks = list(
        client.chat.completions.create(
            model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
    )
    assert chunks and {c.model for c in chunks} == {"a"}
    resp = client.responses.create(model="a", input="hi", max_output_tokens=4, temperature=0)
    assert resp.model == "a" and resp.status == "incomplete"  # max_output_tokens reached
    base_vec = client.embeddings.create(model=lora_server.model_name, input=PROMPT).data[0].embedding
    emb = client.embeddings.create(model="a", input=PROMPT)
    assert emb.model == "a" and emb.data[0].embedding != base_vec
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_adapters_load_and_unload_at_run_time(lora_server, client, adapters, offline) -> None:
    url = lora_server.url
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/dir"})
    assert bad.status_code == 404 and bad.json()["error"] == {  # vLLM's 404 when nothing is there
        "message": "LoRA adapter 'x' (/no/such/dir): No adapter found (no such directory)",
        "type": "NotFoundError",
        "param": "lora_path",
        "code": "not_found",
    }
    empty = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": ""})
    assert (empty.status_code, empty.json()["error"]["message"]) == (
        400,
        "Both 'lora_name' and 'lora_path' must be provided.",
    )
    nameless = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": ""})
    assert (nameless.status_code, nameless.json()["error"]["message"]) == (
        400,
        "'lora_name' needs to be provided to unload a LoRA adapter.",
    )
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully."
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert listed["c"]["root"] == str(adapters["c"]) and listed["c"]["lora_preloaded"] is False
    assert _token_ids(client, "c") == ("c", offline["c"])
    again = httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["a"])}
    )
    assert (again.status_code, again.json()["error"]["message"]) == (
        400,
        "The lora adapter 'c' has already been loaded. If you want to load the adapter in place, "
        "set 'load_inplace' to True.",
    )
    # load_inplace: the name now runs a's weights
    inplace = {"lora_name": "c", "lora_path": str(adapters["a"]), "load_inplace": True}
    assert httpx.post(url + "/v1/load_lora_adapter", json=inplace).status_code == 200
    assert _token_ids(client, "c") == ("c", offline["a"])
    base = httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": lora_server.model_name, "lora_path": "/x"}
    )
    assert base.status_code == 400
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=2)
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    missing = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c"})
    assert missing.status_code == 400
    # Nothing of this cost the others anything.
    assert _token_ids(client, "a") == ("a", offline["a"])


def test_vllms_lora_flags_are_noted(lora_server) -> None:
    log = lora_server.log_path.read_text()
    for note in (
        "--fully-sharded-loras is accepted for vLLM compatibility and changes nothing: a replica runs on one",
        "--lora-dtype is accepted for vLLM compatibility and changes nothing: LoRA adapters run in the model's",
    ):
        assert note in log, note


def test_lora_metrics(lora_server, client) -> None:
    client.completions.create(model="a", prompt=PROMPT, max_tokens=2)
    text = httpx.get(lora_server.url + "/metrics").text
    value = metric_value(text, "vllm:lora_requests_info", max_lora="2", running_lora_adapters="")
    assert value is not None and value > 1.7e9  # the time of the reading, as vLLM's


def test_runtime_updating_needs_enable_lora_and_permission(server, tiny_llama, adapters) -> None:
    # The session's default replica runs without --enable-lora.
    r = httpx.post(
        server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a"])}
    )
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
            model="a", prompt=PROMPT, max_tokens=2
        )


def test_api_servers_share_one_set_of_adapters(
    tiny_llama, adapters, serve_logs, server_process, offline, resolver_dir
) -> None:
    flags = ["--api-server-count", "2", "--enable-lora", "--lora-modules", f"a={adapters['a']}"]
    srv = server_process(tiny_llama, [*flags, "--num-kv-blocks", "256"], serve_logs)
    # vLLM's environment variables: runtime updating, and its filesystem resolver's directory
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "VLLM_PLUGINS": "lora_filesystem_resolver"}
    srv.start(env={**env, "VLLM_LORA_RESOLVER_CACHE_DIR": str(resolver_dir)})
    try:
        first, second = connection_per_api_server(srv)
        # Both API servers asked for one name the resolver holds at once: both run it, loaded once.
        resolve = {"model": "d", "prompt": PROMPT, **GREEDY, "return_token_ids": True}
        for conn in (first, second):
            conn.request("POST", "/v1/completions", json.dumps(resolve), {"content-type": "application/json"})
        for conn in (first, second):
            r = conn.getresponse()
            answer = json.loads(r.read())
            assert r.status == 200 and answer["choices"][0]["token_ids"] == offline["c"], answer
        assert srv.log_path.read_text().count("Resolved LoRA adapter 'd' from") == 1
        body = {"model": "a", "prompt": PROMPT, **GREEDY, "return_token_ids": True}
        for conn in (first, second):
            status, answer = call(conn, "/v1/completions", body)
            assert status == 200 and answer["choices"][0]["token_ids"] == offline["a"]
        status, text = call(
            first, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"])}
        )
        assert status == 200, text
        status, models = call(second, "/v1/models")
        assert "c" in {m["id"] for m in models["data"]}
        status, answer = call(second, "/v1/completions", {**body, "model": "c"})
        assert status == 200 and answer["model"] == "c" and answer["choices"][0]["token_ids"] == offline["c"]
        status, _ = call(second, "/v1/unload_lora_adapter", {"lora_name": "c"})
        assert status == 200
        status, answer = call(first, "/v1/completions", {**body, "model": "c"})
        assert status == 404
        for conn in (first, second):
            conn.close()
    finally:
        assert srv.stop() == 0, srv.log()


def test_lora_modules_json_takes_vllms_fields_only() -> None:
    (module,) = parse_lora_modules(['{"name": "a", "path": "/p", "base_model_name": "m"}'])
    assert (module.lora_name, module.lora_path, module.base_model_name) == ("a", "/p", "m")
    with pytest.raises(ValueError, match=r"unknown fields \['base_model'\]"):
        parse_lora_modules(['{"name": "a", "path": "/p", "base_model": "m"}'])


def test_lora_startup_errors_are_clean(tiny_llama, adapters, tmp_path) -> None:
    done = _serve(["--model", str(tiny_llama), "--lora-modules", f"a={adapters['a']}"])
    assert done.returncode == 2 and "--lora-modules needs --enable-lora" in done.stderr
    done = _serve(["--model", str(tiny_llama), "--enable-lora", "--lora-modules", "a"])
    assert done.returncode == 2 and "expected name=path" in done.stderr
    big = build_lora_adapter(tmp_path / "big", tiny_llama, rank=32)
    for extra in ([], ["--api-server-count", "2"]):
        done = _serve(
            [
                "--model",
                str(tiny_llama),
                "--port",
                "0",
                "--enable-lora",
                "--lora-modules",
                f"big={big}",
                *extra,
            ]
        )
        assert done.returncode == 2, done.stderr
        assert "has rank 32, more than max_lora_rank=16" in done.stderr


def test_beam_search_runs_the_named_adapter(client, tiny_llama: Path, adapters) -> None:
    from engine import BeamSearchParams

    with LLM(str(tiny_llama), enable_lora=True, num_kv_blocks=64, num_threads=1) as llm:
        lora = LoRARequest("a", 1, str(adapters["a"]))
        params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
        beams = llm.beam_search([PROMPT], params, lora_request=lora)[0].sequences
        base = llm.beam_search([PROMPT], params)[0].sequences
    assert [b.tokens for b in beams] != [b.tokens for b in base]
    r = client.completions.create(
        model="a",
        prompt=PROMPT,
        n=2,
        max_tokens=6,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True},
    )
    prompt_len = len(beams[0].tokens) - 6
    assert r.model == "a"
    assert [c.token_ids for c in r.choices] == [b.tokens[prompt_len:] for b in beams]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_resolver_loads_an_unknown_name_once(lora_server, client, resolver_dir) -> None:
    url = lora_server.url
    assert httpx.get(url + "/health").json()["lora_resolver"] is True  # what a router reads
    body = json.dumps({"model": "e", "prompt": PROMPT, **GREEDY, "return_token_ids": True})
    conns = [HTTPConnection("127.0.0.1", lora_server.port, timeout=60) for _ in range(8)]
    for conn in conns:
        assert call(conn, "/health")[0] == 200  # connected before the requests are sent
    for conn in conns:  # sent back to back: they meet in the resolver
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    answers = []
    for conn in conns:
        r = conn.getresponse()
        answers.append((r.status, json.loads(r.read())))
        conn.close()
    assert [status for status, _ in answers] == [200] * 8, answers
    assert {a["model"] for _, a in answers} == {"e"}
    (tokens,) = {tuple(a["choices"][0]["token_ids"]) for _, a in answers}
    log = lora_server.log_path.read_text()
    assert log.count("Loading LoRA adapter 'e' from the resolver directory") == 1  # one load for 8
    assert log.count("Resolved LoRA adapter 'e' from") == 1
    card = {m.id: m.model_dump() for m in client.models.list().data}["e"]
    assert (card["root"], card["parent"]) == (str(resolver_dir.resolve() / "e"), lora_server.model_name)
    assert (card["lora_preloaded"], card["lora_resolved"]) == (False, True)  # routers do not adopt it
    # The same files loaded explicitly answer the same.
    load = {"lora_name": "e_explicit", "lora_path": str(resolver_dir / "e")}
    assert _post(url, "/v1/load_lora_adapter", load).status_code == 200
    assert _token_ids(client, "e_explicit") == ("e_explicit", list(tokens))
    card = {m.id: m.model_dump() for m in client.models.list().data}["e_explicit"]
    assert card["lora_resolved"] is False  # not what a request naming e_explicit would load
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "e_explicit"}).status_code == 200
    # Unloaded, a resolved adapter is resolved again by the next request naming it.
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "e"}).status_code == 200
    assert _token_ids(client, "e") == ("e", list(tokens))
    assert lora_server.log_path.read_text().count("Resolved LoRA adapter 'e' from") == 2


def test_resolver_serves_every_route(lora_server, client, offline) -> None:
    url = lora_server.url
    chat = client.chat.completions.create(
        model="via_chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.model == "via_chat"
    assert (
        client.responses.create(model="via_responses", input="hi", max_output_tokens=2).model
        == "via_responses"
    )
    messages = {"model": "via_messages", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    answer = _post(url, "/v1/messages", messages)
    assert answer.status_code == 200 and answer.json()["model"] == "via_messages"
    emb = client.embeddings.create(model="via_embeddings", input=PROMPT)
    assert emb.model == "via_embeddings"
    tok = _post(url, "/tokenize", {"model": "via_tokenize", "prompt": PROMPT})
    assert tok.status_code == 200
    listed = {m.id for m in client.models.list().data}
    assert set(RESOLVED_ROUTES) <= listed
    # --max-cpu-loras is 2 (--max-loras): the adapters resolved first were evicted, and are read
    # again when named, as runtime loads are. "d" holds c's weights: c's answer.
    assert _token_ids(client, "via_chat") == ("via_chat", offline["c"])
    assert _token_ids(client, "d") == ("d", offline["c"])


def test_resolver_refusals(lora_server, client, resolver_dir, tiny_llama) -> None:
    url = lora_server.url
    base = {"prompt": PROMPT, "max_tokens": 2}
    for name in ("nope", "empty"):  # nothing there, or no adapter there: today's 404
        r = _post(url, "/v1/completions", {**base, "model": name})
        assert (r.status_code, r.json()["error"]) == (
            404,
            {
                "message": f"The model `{name}` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": "model_not_found",
            },
        )
    outside = (
        "cannot be resolved as a LoRA adapter: the name must be a relative path inside the resolver "
        "directory (no absolute path, '.', '..' or link out of it)."
    )
    for name in ("out", "../e", "d/../e", str(resolver_dir / "d"), "./d"):
        r = _post(url, "/v1/completions", {**base, "model": name})
        assert (r.status_code, r.json()["error"]) == (
            400,
            {
                "message": f"The model `{name}` {outside}",
                "type": "BadRequestError",
                "param": "model",
                "code": "invalid_value",
            },
        ), name
    listed = {m.id for m in client.models.list().data}
    assert not listed & {"out", "../e", "empty", "nope"}
    # An adapter that cannot run on this model: a 400 saying why, the files read once while unchanged.
    path = resolver_dir.resolve() / "big"
    why = f"LoRA adapter 'big' ({path}): "
    for route, body in (
        ("/v1/completions", {**base, "model": "big"}),
        ("/v1/chat/completions", {"model": "big", "messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = _post(url, route, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"LoRA adapter 'big' was found but could not be loaded: {why}"), message
        assert message.endswith("has rank 32, more than max_lora_rank=16"), message
    log = lora_server.log_path.read_text()
    assert log.count("Loading LoRA adapter 'big' from the resolver directory") == 1
    # Fixed (new files): read again, and served.
    build_lora_adapter(resolver_dir / "big", tiny_llama, seed=5, rank=8)
    r = _post(url, "/v1/completions", {**base, "model": "big"})
    assert r.status_code == 200 and r.json()["model"] == "big"
    assert (
        lora_server.log_path.read_text().count("Loading LoRA adapter 'big' from the resolver directory") == 2
    )


def test_vllms_resolver_environment(tmp_path) -> None:
    d, real = str(tmp_path), os.path.realpath(tmp_path)
    assert (
        env_resolver_dir(None, {"VLLM_LORA_RESOLVER_CACHE_DIR": d}) == real
    )  # VLLM_PLUGINS unset: all plugins
    named = {"VLLM_LORA_RESOLVER_CACHE_DIR": d, "VLLM_PLUGINS": "other, lora_filesystem_resolver"}
    assert env_resolver_dir(None, named) == real
    assert env_resolver_dir(None, {**named, "VLLM_PLUGINS": "other"}) is None
    assert env_resolver_dir(None, {}) is None
    assert env_resolver_dir(d, {"VLLM_PLUGINS": "other"}) == real  # the flag needs no plugin
    with pytest.raises(ValueError, match="VLLM_LORA_RESOLVER_CACHE_DIR '/no/such' is not a directory"):
        env_resolver_dir(None, {"VLLM_LORA_RESOLVER_CACHE_DIR": "/no/such"})


def test_resolver_flag_needs_runtime_updating(tiny_llama, resolver_dir, tmp_path) -> None:
    done = _serve(["--model", str(tiny_llama), "--enable-lora", "--lora-resolver-dir", str(resolver_dir)])
    assert done.returncode == 2
    assert "--lora-resolver-dir needs --enable-lora and --allow-runtime-lora-updating" in done.stderr
    flags = ["--enable-lora", "--allow-runtime-lora-updating", "--lora-resolver-dir", str(tmp_path / "no")]
    done = _serve(["--model", str(tiny_llama), *flags])
    assert (
        done.returncode == 2 and f"--lora-resolver-dir '{tmp_path / 'no'}' is not a directory" in done.stderr
    )
