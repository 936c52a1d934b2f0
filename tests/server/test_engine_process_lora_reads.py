"""The engine process reads a request's LoRA adapter off its event loop, even when other
requests' adapters evict it from the loaded set (``max_cpu_loras``) while the request's other
inputs are prepared (``EngineHost`` and an ``EngineClient`` over a real Unix socket, one event loop)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.demo import build_lora_adapter
from engine.lora_request import LoRARequest
from engine.sampling_params import StructuredOutputsParams
from server.engine_client import EngineClient
from server.engine_host import EngineHost
from tests.server.test_engine_ipc import _hosted

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
DIGITS = SamplingParams(
    temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]{1,3}")
)


@pytest.fixture(scope="module")
def two_adapters(tmp_path_factory, tiny_llama: Path) -> list[Path]:
    root = tmp_path_factory.mktemp("evicted_adapters")
    return [build_lora_adapter(root / f"a{seed}", tiny_llama, seed=seed) for seed in (1, 2)]


async def _collect(client: EngineClient, rid: str, params: SamplingParams, lora: LoRARequest) -> list[int]:
    tokens: list[int] = []
    async for out in client.generate(rid, [5, 6, 7, 8], params, lora_request=lora):
        tokens += out.outputs[0].token_ids
    return tokens


async def test_an_adapter_evicted_while_its_request_compiles_is_not_read_on_the_loop(
    tiny_llama, two_adapters
) -> None:
    """One adapter kept loaded. Request A (adapter a, a constraint to compile) had its adapter
    loaded first and compiled after; request B's adapter b, loaded meanwhile, evicted a. A's
    ``start`` then found a unloaded and read its files on the engine process's event loop, which
    relays every API server's outputs (a disk read of a real adapter: tens of ms to seconds)."""
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=128, enable_lora=True, max_loras=1)
    engine = AsyncEngine(config)
    loop_thread = threading.get_ident()
    reads: list[tuple[str, bool]] = []  # (adapter, read on the event loop)
    read_lora, load_lora, compile_structured = (
        engine.engine.read_lora,
        engine.engine.load_lora,
        engine.compile_structured,
    )
    b_loaded = asyncio.Event()

    def recorded_read(request: LoRARequest):  # noqa: ANN202
        reads.append((request.lora_name, threading.get_ident() == loop_thread))
        return read_lora(request)

    def noted_load(request: LoRARequest, adapter=None):  # noqa: ANN001, ANN202
        loaded = load_lora(request, adapter)
        if request.lora_name == "b":
            b_loaded.set()
        return loaded

    async def compile_once_b_is_loaded(spec):  # noqa: ANN001, ANN202
        await b_loaded.wait()  # B's adapter comes in while A's constraint compiles
        return await compile_structured(spec)

    engine.engine.read_lora = recorded_read
    engine.engine.load_lora = noted_load
    engine.compile_structured = compile_once_b_is_loaded
    a = LoRARequest("a", 1, str(two_adapters[0]))
    b = LoRARequest("b", 2, str(two_adapters[1]))
    try:
        async with _hosted(EngineHost(engine)) as where:
            client = await EngineClient.connect(where)
            got = await asyncio.wait_for(
                asyncio.gather(_collect(client, "A", DIGITS, a), _collect(client, "B", PARAMS, b)), 60
            )
            await client.shutdown()
    finally:
        await engine.shutdown()
    assert [len(tokens) > 0 for tokens in got] == [True, True]
    assert sorted(reads) == [("a", False), ("b", False)]
