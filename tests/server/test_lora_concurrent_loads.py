"""Loads of one LoRA adapter name that meet (``POST /v1/load_lora_adapter`` at the same moment),
with one process and behind two API servers: the engine takes them in turn, so of two loads of a
new name one is served and the other refused as sequential ones are, and after two ``load_inplace``
loads every API server lists (and runs) the adapter the engine kept."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path

import pytest

from engine.demo import build_lora_adapter
from engine.lora import adapter_weights_id
from tests.server.test_api_servers import call, connection_per_api_server

_numbers = itertools.count()  # a new adapter name each time
FLAGS = ["--enable-lora", "--allow-runtime-lora-updating", "--max-lora-rank", "64", "--num-kv-blocks", "128"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama: Path) -> list[Path]:
    """Two adapters of rank 64: their files take a few ms to read, while the other load arrives."""
    root = tmp_path_factory.mktemp("concurrent_adapters")
    return [build_lora_adapter(root / f"r{seed}", tiny_llama, seed=seed, rank=64) for seed in (1, 2)]


@pytest.fixture(scope="module", params=["one process", "api servers"])
def replica(request, tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = FLAGS + (["--api-server-count", "2"] if request.param == "api servers" else [])
    srv = server_process(tiny_llama, flags, serve_logs).start()
    srv.api_servers = request.param == "api servers"
    yield srv
    assert srv.stop() == 0, srv.log()


def _connections(replica) -> list[HTTPConnection]:
    """Two keep-alive connections: one to each API server behind two."""
    if replica.api_servers:
        return connection_per_api_server(replica)
    conns = [HTTPConnection("127.0.0.1", replica.port, timeout=60) for _ in range(2)]
    for conn in conns:
        assert call(conn, "/health")[0] == 200  # connected before the loads are sent
    return conns


def _load_at_once(conns: list[HTTPConnection], bodies: list[dict]) -> list[tuple[int, object]]:
    """Each body sent on its connection back to back (microseconds apart), then each answer."""
    for conn, body in zip(conns, bodies, strict=True):
        conn.request("POST", "/v1/load_lora_adapter", json.dumps(body), {"content-type": "application/json"})
    answers = []
    for conn in conns:
        r = conn.getresponse()
        data = r.read().decode()
        answers.append((r.status, json.loads(data) if data.startswith("{") else data))
    return answers


def _adapter(conn: HTTPConnection, name: str) -> tuple[str, str] | None:
    """The directory and weights digest that ``name`` means to the API server behind ``conn``
    (None: not an adapter there)."""
    status, models = call(conn, "/v1/models")
    assert status == 200
    cards = {m["id"]: (m["root"], m.get("lora_weights_id")) for m in models["data"]}
    return cards.get(name)


def test_of_two_loads_of_a_new_name_one_wins(replica, adapters) -> None:
    conns = _connections(replica)
    for _ in range(5):
        name = f"new{next(_numbers)}"
        bodies = [{"lora_name": name, "lora_path": str(path)} for path in adapters]
        answers = _load_at_once(conns, bodies)
        assert sorted(status for status, _ in answers) == [200, 400], answers
        won = 0 if answers[0][0] == 200 else 1
        assert answers[won][1] == f"Success: LoRA adapter '{name}' added successfully."
        assert answers[1 - won][1]["error"] == {
            "message": f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
            "in place, set 'load_inplace' to True.",
            "type": "BadRequestError",
            "param": "lora_name",
            "code": "invalid_value",
        }
        winner = (str(adapters[won]), adapter_weights_id(adapters[won]))
        assert [_adapter(conn, name) for conn in conns] == [winner, winner]
    for conn in conns:
        conn.close()


@pytest.mark.parametrize("replica", ["api servers"], indirect=True)
def test_api_servers_agree_after_two_inplace_loads_of_one_name(replica, adapters) -> None:
    conns = connection_per_api_server(replica)
    either = {(str(path), adapter_weights_id(path)) for path in adapters}
    greedy = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    # When an API server also wrote its copy from its own call's reply, they disagreed after about
    # one pair of loads in five.
    for trial in range(50):
        name = f"swap{next(_numbers)}"
        bodies = [{"lora_name": name, "lora_path": str(path), "load_inplace": True} for path in adapters]
        answers = _load_at_once(conns, bodies)
        assert [status for status, _ in answers] == [200, 200], answers
        first, second = (_adapter(conn, name) for conn in conns)
        assert first == second, f"trial {trial}: the API servers disagree on {name!r}"
        assert first in either
    # Both run the same weights under that name.
    texts = []
    for conn in conns:
        status, answer = call(conn, "/v1/completions", {**greedy, "model": name})
        assert status == 200, answer
        texts.append(answer["choices"][0]["text"])
    assert texts[0] == texts[1]
    for conn in conns:
        conn.close()


@pytest.mark.parametrize("replica", ["api servers"], indirect=True)
def test_a_change_answered_through_one_api_server_holds_through_the_other(replica, adapters) -> None:
    """Once one API server answered a load (or an unload), the other serves what it says: the
    answer waits until every API server has the new set, not only the one that answered."""
    first, second = connection_per_api_server(replica)
    loaded = (str(adapters[0]), adapter_weights_id(adapters[0]))
    # Before, the other API server still missed the change one time in ten or twenty.
    for _ in range(30):
        name = f"seen{next(_numbers)}"
        body = {"lora_name": name, "lora_path": str(adapters[0])}
        assert call(first, "/v1/load_lora_adapter", body)[0] == 200
        assert _adapter(second, name) == loaded
        assert call(second, "/v1/unload_lora_adapter", {"lora_name": name})[0] == 200
        assert _adapter(first, name) is None
    first.close()
    second.close()
