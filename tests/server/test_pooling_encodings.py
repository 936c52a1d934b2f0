"""vLLM's encodings of pooled vectors on ``/v1/embeddings`` and ``/pooling``: ``base64`` carries the
float answer's float32 values cast to ``embed_dtype`` (float32, float16, bfloat16, fp8 e4m3 / e5m2)
in ``endianness``'s byte order, bit for bit as torch casts them (``engine.pooling.encode_values``
against torch on two million float32 values too); ``bytes`` answers the same bytes as the body with
a ``metadata`` header locating each vector (``bytes_only``: no header); bad values are 400s naming
the field. Usage is vLLM's ``UsageInfo`` (``completion_tokens`` 0, ``prompt_tokens_details`` null)
on every pooling route but ``/rerank`` (vLLM's ``RerankUsage``); ``use_activation`` (vLLM's
spelling) turns the embedding's normalisation off; ``/invocations`` serves a pooling-shaped
``input`` body by ``/v1/embeddings``, as vLLM's order of trials does."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from engine.pooling import EMBED_DTYPES, ENDIANNESS, encode_values
from engine.tokenizer import Tokenizer
from server.embedding_protocol import EmbedDType, Endianness
from tests.server.test_pooling_endpoint import _ok, _post

TEXTS = ["def parse_args(argv):", "import os\nimport sys\n\nprint(sys.argv)", "x = 1"]
TORCH = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
# (mantissa bits, exponent bias) of the formats numpy lacks, to decode them here from their bits.
SMALL_FLOATS = {"bfloat16": (7, 127), "fp8_e4m3": (3, 7), "fp8_e5m2": (2, 15)}


@pytest.fixture(scope="module")
def srv(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    # Batch-invariant numerics: a vector is the same bits in every request, so answers compare exactly.
    server = server_process(tiny_llama, ["--deterministic", "--num-kv-blocks", "64"], serve_logs).start()
    yield server
    server.stop()


def _vectors(answer: dict) -> list:
    return [d["embedding"] if "embedding" in d else d["data"] for d in answer["data"]]


def _torch_bytes(values: list[float], dtype: str, endianness: str) -> bytes:
    """What vLLM sends: torch's cast of the float32 values, byte-swapped unless in native order."""
    t = torch.tensor(values, dtype=torch.float32).to(TORCH[dtype])
    raw = t.view(BITS[t.element_size()]).numpy()
    if endianness not in ("native", sys.byteorder):
        raw = raw.byteswap()
    return raw.tobytes()


def _decode(raw: bytes, dtype: str, endianness: str) -> np.ndarray:
    """The bytes as float64 values, decoded with numpy from the format's definition."""
    order = {"native": "=", "little": "<", "big": ">"}[endianness]
    if dtype in ("float32", "float16"):
        return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder(order)).astype(np.float64)
    mantissa, bias = SMALL_FLOATS[dtype]
    width = 16 if dtype == "bfloat16" else 8
    bits = np.frombuffer(raw, dtype=np.dtype("u2" if width == 16 else "u1").newbyteorder(order)).astype(
        np.int64
    )
    sign = np.where(bits >> (width - 1), -1.0, 1.0)
    exponent = (bits >> mantissa) & ((1 << (width - 1 - mantissa)) - 1)
    fraction = (bits & ((1 << mantissa) - 1)) / 2.0**mantissa
    normal = np.ldexp(1.0 + fraction, (exponent - bias).astype(np.int32))
    subnormal = np.ldexp(fraction, 1 - bias)
    return sign * np.where(exponent == 0, subnormal, normal)


def test_the_request_types_name_every_dtype_the_codec_casts() -> None:
    from typing import get_args

    assert get_args(EmbedDType) == EMBED_DTYPES == tuple(TORCH)
    assert get_args(Endianness) == ENDIANNESS == ("native", "big", "little")


def test_codec_casts_as_torch_does_bit_for_bit() -> None:
    rng = np.random.default_rng(7)
    everything = rng.integers(0, 2**32, size=2_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = [0.0, -0.0, 448, 449, 464, 470, 480, 1e4, 57344, 61439, 61440, 65536, 2**-6, 2**-9, 2**-10]
    edges += [2**-14, 2**-16, 2**-17, 2**-18, 1e-9, -1e-9, 3e38, float("inf"), float("-inf")]
    # NaNs included (7,777 of them here, both signs, every payload), quieted as the float64 answer's
    # rounding to float32 quiets them: the float32 values the client decodes against.
    with np.errstate(invalid="ignore"):
        quieted = everything.astype(np.float64).astype(np.float32)
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):  # torch's scalar cast: 0x7FC0
        quieted = quieted[~np.isnan(quieted)]
    values = np.concatenate([quieted, np.float32(edges), rng.normal(size=10_000)]).astype(np.float32)
    for dtype in EMBED_DTYPES:
        for endianness in ENDIANNESS:
            assert encode_values(values, dtype, endianness) == _torch_bytes(
                values.tolist(), dtype, endianness
            ), (
                dtype,
                endianness,
            )


def test_nan_has_torchs_bit_pattern_in_every_dtype() -> None:
    # bfloat16 NaN is 0xFFFF whatever its sign and payload, as torch's vectorised CPU cast (AVX2 /
    # AVX512: vLLM's ``tensor.to(torch.bfloat16)`` on an x86 server) writes it; it was 0x7FC0.
    # float16 keeps sign and payload, fp8 keeps the sign (0x7F / 0xFF), as torch does.
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFFFFFFFF], dtype=np.uint32).view(np.float32)
    values = np.concatenate([nans, np.float32([1.0])])
    want = {
        "float32": ["7fc00000", "ffc00000", "7fc12345", "ffffffff", "3f800000"],
        "float16": ["7e00", "fe00", "7e09", "ffff", "3c00"],
        "bfloat16": ["ffff", "ffff", "ffff", "ffff", "3f80"],
        "fp8_e4m3": ["7f", "ff", "7f", "ff", "38"],
        "fp8_e5m2": ["7f", "ff", "7f", "ff", "3c"],
    }
    for dtype, big in want.items():
        assert encode_values(values, dtype, "big").hex() == "".join(big), dtype
        # The same float32 tensor through torch on this machine: identical bits (torch's scalar path,
        # ATEN_CPU_CAPABILITY=default, writes bfloat16 NaN as 0x7FC0 and is not what vLLM runs).
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            assert encode_values(values, dtype, "big") == _torch_bytes(values.tolist(), dtype, "big"), dtype


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_base64_is_the_float_answer_cast_to_embed_dtype_in_endianness(srv, path: str) -> None:
    floats = _vectors(_ok(srv, path, {"input": TEXTS}))
    assert len(floats) == 3 and len(floats[0]) == 64
    for dtype in EMBED_DTYPES:
        for endianness in ENDIANNESS:
            body = {
                "input": TEXTS,
                "encoding_format": "base64",
                "embed_dtype": dtype,
                "endianness": endianness,
            }
            packed = _vectors(_ok(srv, path, body))
            for vector, text in zip(floats, packed, strict=True):
                raw = base64.b64decode(text)
                assert raw == _torch_bytes(vector, dtype, endianness), (dtype, endianness)
                # The bytes decode (by the format's definition) to the float answer within its precision.
                mantissa = {"float32": 23, "float16": 10, **{k: m for k, (m, _) in SMALL_FLOATS.items()}}[
                    dtype
                ]
                got, want = _decode(raw, dtype, endianness), np.asarray(vector, dtype=np.float64)
                tiny = 2.0 ** {"float16": -24, "fp8_e4m3": -9, "fp8_e5m2": -16}.get(dtype, -126)
                assert np.all(np.abs(got - want) <= np.abs(want) * 2.0 ** -(mantissa + 1) + tiny), dtype
    # The default: float32 in this machine's order, as OpenAI's SDK decodes base64 on it.
    default = _vectors(_ok(srv, path, {"input": TEXTS, "encoding_format": "base64"}))
    assert [base64.b64decode(t) for t in default] == [np.float32(v).tobytes() for v in floats]


@pytest.mark.parametrize(("path", "prefix"), [("/v1/embeddings", "embd-"), ("/pooling", "pool-")])
def test_bytes_answer_the_vectors_as_the_body_with_their_metadata(
    srv, tiny_llama: Path, path, prefix
) -> None:
    floats = _vectors(_ok(srv, path, {"input": TEXTS}))
    tokens = sum(len(Tokenizer.from_dir(tiny_llama).encode(t)) for t in TEXTS)
    body = {"input": TEXTS, "encoding_format": "bytes", "embed_dtype": "bfloat16", "endianness": "big"}
    r = _post(srv, path, body, {"X-Request-Id": "bin-7"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    want = [_torch_bytes(v, "bfloat16", "big") for v in floats]
    assert r.content == b"".join(want) and len(r.content) == 3 * 64 * 2
    meta = json.loads(r.headers["metadata"])
    assert set(meta) == {"id", "created", "model", "data", "usage"}
    assert (
        meta["id"] == prefix + "bin-7"
        and meta["model"] == srv.model_name
        and isinstance(meta["created"], int)
    )
    assert meta["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert meta["data"] == [
        {
            "index": i,
            "embed_dtype": "bfloat16",
            "endianness": "big",
            "start": 128 * i,
            "end": 128 * (i + 1),
            "shape": [64],
        }
        for i in range(3)
    ]
    only = _post(srv, path, {**body, "encoding_format": "bytes_only", "embed_dtype": "fp8_e5m2"})
    assert only.status_code == 200 and "metadata" not in only.headers
    assert only.content == b"".join(_torch_bytes(v, "fp8_e5m2", "big") for v in floats)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("embed_dtype", "float64"),
        ("embed_dtype", "fp8"),
        ("embed_dtype", 16),
        ("endianness", "middle"),
        ("endianness", "BIG"),
        ("encoding_format", "binary"),
        ("use_activation", "no"),
    ],
)
def test_bad_values_are_400s_naming_the_field(srv, path: str, field: str, value) -> None:
    r = _post(srv, path, {"input": TEXTS[0], "encoding_format": "base64", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_usage_is_vllms_on_each_pooling_route(srv, tiny_llama: Path) -> None:
    tok = Tokenizer.from_dir(tiny_llama)
    n = sum(len(tok.encode(t)) for t in TEXTS)
    full = {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}
    for path, body in (
        ("/v1/embeddings", {"input": TEXTS}),
        ("/pooling", {"input": TEXTS}),
        ("/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]}),
    ):
        assert _ok(srv, path, body)["usage"] == full, path
    rerank = _ok(srv, "/rerank", {"query": TEXTS[0], "documents": TEXTS[1:]})
    assert rerank["usage"] == {"prompt_tokens": n, "total_tokens": n}
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    sdk = client.embeddings.create(model=srv.model_name, input=TEXTS)  # base64 float32, decoded by the SDK
    assert (sdk.usage.prompt_tokens, sdk.usage.total_tokens, sdk.usage.completion_tokens) == (n, n, 0)
    assert [d.embedding for d in sdk.data] == _vectors(_ok(srv, "/v1/embeddings", {"input": TEXTS}))


def test_use_activation_is_normalize(srv) -> None:
    raw = _vectors(_ok(srv, "/v1/embeddings", {"input": TEXTS, "normalize": False}))
    unit = _vectors(_ok(srv, "/v1/embeddings", {"input": TEXTS}))
    assert raw != unit
    assert _vectors(_ok(srv, "/v1/embeddings", {"input": TEXTS, "use_activation": False})) == raw
    both = {"input": TEXTS, "use_activation": True, "normalize": False}  # vLLM's older spelling wins
    assert _vectors(_ok(srv, "/v1/embeddings", both)) == raw


def test_invocations_serve_a_pooling_shaped_input_body_as_embeddings(srv) -> None:
    body = {
        "input": TEXTS,
        "task": "embed",
        "use_activation": False,
        "encoding_format": "base64",
        "embed_dtype": "float16",
        "endianness": "little",
    }
    direct = _ok(srv, "/v1/embeddings", body)
    via = _ok(srv, "/invocations", body)
    assert via["id"].startswith("embd-") and via["id"] != direct["id"]  # each request's own id
    for volatile in ("id", "created"):
        via.pop(volatile), direct.pop(volatile)
    assert via == direct and via["data"][0]["object"] == "embedding"
    packed = _post(srv, "/invocations", {**body, "encoding_format": "bytes_only"})
    assert packed.status_code == 200 and packed.headers["content-type"] == "application/octet-stream"
    assert packed.content == b"".join(base64.b64decode(d["embedding"]) for d in direct["data"])
