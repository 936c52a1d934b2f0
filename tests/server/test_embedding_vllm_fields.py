"""What vLLM answers on the pooling routes beyond OpenAI's shape, and how the Batch API meets the
binary encodings.

``/v1/embeddings`` answers carry vLLM's ``id`` (``embd-`` and the request id, the same id the
``bytes`` metadata names) and ``created``; OpenAI's SDK parses them as before and keeps both as
extras. ``normalize`` wins over ``use_activation`` when both are given, on ``/v1/embeddings`` and
``/pooling`` alike (vLLM's ``get_use_activation``: the older spelling first). A batch line for
``/v1/embeddings`` with ``encoding_format`` ``bytes`` or ``bytes_only`` (an octet-stream answer no
output line can hold) is refused where ``stream: true`` is: at upload, a 400 naming the line, and
in ``ferry run-batch``, an error line in its place."""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from ferry.cli import main
from server.batch_lines import BatchRequestLine, parse_line

TEXTS = ["def parse_args(argv):", "import os\nimport sys\n\nprint(sys.argv)", "x = 1"]
KEYS = {"id", "object", "created", "model", "data", "usage"}


def _post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def _ok(server, path: str, body: dict, headers: dict | None = None) -> dict:
    r = _post(server, path, body, headers)
    assert r.status_code == 200, r.text
    return r.json()


def _vectors(answer: dict) -> list[list[float]]:
    return [d["embedding"] if "embedding" in d else d["data"] for d in answer["data"]]


def _same(got: list[list[float]], want: list[list[float]]) -> bool:
    """The same vectors up to float32 rounding: the shared replica is not ``--deterministic``, and a
    prompt whose blocks are cached computes its last rows apart from the rest."""
    a, b = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-4, atol=1e-6))


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_embeddings_answer_vllms_id_and_created(server, client: openai.OpenAI) -> None:
    before = int(time.time())
    answer = _ok(server, "/v1/embeddings", {"input": TEXTS}, {"X-Request-Id": "emb-ids-1"})
    after = int(time.time())
    assert set(answer) == KEYS and list(answer)[:3] == ["id", "object", "created"]  # vLLM's order
    assert answer["id"] == "embd-emb-ids-1" and before <= answer["created"] <= after
    assert answer["object"] == "list" and len(answer["data"]) == 3
    # No X-Request-Id: the id the replica gave the request (echoed in the header).
    r = _post(server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    assert r.status_code == 200 and r.json()["id"] == "embd-" + r.headers["x-request-id"]
    # The bytes answer's metadata names the same id for the same request id.
    packed = _post(
        server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "bytes"}, {"X-Request-Id": "emb-ids-1"}
    )
    assert packed.status_code == 200 and json.loads(packed.headers["metadata"])["id"] == "embd-emb-ids-1"
    # OpenAI's SDK: the same vectors and usage, the two new fields kept as extras.
    sdk = client.embeddings.create(
        model=server.model_name, input=TEXTS, encoding_format="float", extra_headers={"X-Request-Id": "sdk-9"}
    )
    assert _same([d.embedding for d in sdk.data], _vectors(answer))
    assert sdk.usage.prompt_tokens == answer["usage"]["prompt_tokens"] and sdk.object == "list"
    assert sdk.model_extra["id"] == "embd-sdk-9" and isinstance(sdk.model_extra["created"], int)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_normalize_wins_over_use_activation(server, path: str) -> None:
    unit = _vectors(_ok(server, path, {"input": TEXTS}))
    raw = _vectors(_ok(server, path, {"input": TEXTS, "normalize": False}))
    norms = np.linalg.norm(np.asarray(raw, dtype=np.float64), axis=1)
    assert np.all(np.abs(norms - 1) > 0.1)  # the raw state is far from a unit vector: the two tell apart
    assert _same(unit, np.asarray(raw) / norms[:, None])
    cases = [
        ({"use_activation": False}, raw),
        ({"use_activation": True}, unit),
        ({"normalize": False, "use_activation": True}, raw),
        ({"normalize": True, "use_activation": False}, unit),
        ({"normalize": None, "use_activation": False}, raw),  # null is unset
    ]
    for flags, want in cases:
        assert _same(_vectors(_ok(server, path, {"input": TEXTS, **flags})), want), flags


@pytest.mark.parametrize("encoding", ["bytes", "bytes_only"])
def test_a_binary_embeddings_line_is_refused_as_a_streaming_one(encoding: str) -> None:
    body = {"input": "x", "encoding_format": encoding, "embed_dtype": "float16"}
    custom_id, error = parse_line(_line("bin", "/v1/embeddings", body))  # type: ignore[misc]
    assert custom_id == "bin"
    assert error == {
        "error": {
            "message": f"encoding_format '{encoding}' answers binary data, which a batch output line cannot "
            "hold: use 'float' or 'base64'.",
            "type": "BadRequestError",
            "param": None,
            "code": "binary_encoding_not_supported",
        }
    }
    # JSON encodings pass, and another route's body is its own business (chat ignores the field).
    for fmt in ("float", "base64"):
        assert isinstance(
            parse_line(_line("ok", "/v1/embeddings", {**body, "encoding_format": fmt})), BatchRequestLine
        )
    chat = {"messages": [{"role": "user", "content": "x"}], "encoding_format": encoding}
    assert isinstance(parse_line(_line("chat", "/v1/chat/completions", chat)), BatchRequestLine)


def test_upload_with_a_binary_embeddings_line_is_a_400_naming_it(server) -> None:
    lines = [
        _line("a", "/v1/embeddings", {"input": "x"}),
        _line("b", "/v1/embeddings", {"input": "y", "encoding_format": "bytes_only"}),
    ]
    data = ("\n".join(lines) + "\n").encode()
    r = httpx.post(
        server.url + "/v1/files",
        files={"file": ("requests.jsonl", io.BytesIO(data))},
        data={"purpose": "batch"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        "Line 2 of the batch file: encoding_format 'bytes_only' answers binary data, which a batch "
        "output line cannot hold: use 'float' or 'base64'."
    )
    assert r.json()["error"]["param"] == "file"
    ok = httpx.post(
        server.url + "/v1/files",
        files={"file": ("requests.jsonl", io.BytesIO((lines[0] + "\n").encode()))},
        data={"purpose": "batch"},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["purpose"] == "batch"


def test_run_batch_answers_a_binary_line_with_an_error_line(tiny_llama: Path, tmp_path: Path) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(
        _line("bin", "/v1/embeddings", {"input": "x", "encoding_format": "bytes"})
        + "\n"
        + _line("b64", "/v1/embeddings", {"input": "x", "encoding_format": "base64"})
        + "\n"
    )
    assert (
        main(
            [
                "run-batch",
                "-i",
                str(source),
                "-o",
                str(target),
                "--model",
                str(tiny_llama),
                "--num-threads",
                "1",
            ]
        )
        == 0
    )
    binary, b64 = (json.loads(line) for line in target.read_text().splitlines())
    assert binary["custom_id"] == "bin" and binary["response"]["status_code"] == 400
    assert binary["error"] == {
        "code": "binary_encoding_not_supported",
        "message": "encoding_format 'bytes' answers binary data, which a batch output line cannot hold: "
        "use 'float' or 'base64'.",
    }
    body = b64["response"]["body"]
    assert b64["error"] is None and body["id"] == "embd-" + b64["response"]["request_id"]
    assert len(np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), np.float32)) == 64
