"""LoRA adapters served by one replica, as vLLM serves them.

``--enable-lora --lora-modules name=path …`` loads adapters at start; a request whose ``model`` is an
adapter's name runs with it, and its answer carries that name. ``/v1/models`` lists each adapter
with its base model as ``parent``. ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
change the set at run time, when ``--allow-runtime-lora-updating`` (or vLLM's environment variable
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``) allows it. The set lives in the engine
(``AsyncEngine.served_loras``), so every API server process of a replica sees one set; the engine
also decides whether a name is taken, so of two loads of a new name that meet, one wins.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from pydantic import StrictBool, StrictInt, StrictStr

from engine.lora_request import NO_ADAPTER, LoRARequest
from server.errors import APIError, bad_request
from server.protocol import ModelCard, _Request

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_int_ids = itertools.count(1)


class LoadLoRAAdapterRequest(_Request):
    lora_name: StrictStr
    lora_path: StrictStr
    load_inplace: StrictBool = False  # replace an adapter already served under this name


class UnloadLoRAAdapterRequest(_Request):
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None


_JSON_FIELDS = frozenset(("name", "path", "base_model_name"))


def parse_lora_modules(values: list[str] | None) -> tuple[LoRARequest, ...]:
    """``--lora-modules`` entries: ``name=path`` or vLLM's JSON form
    ``{"name": …, "path": …, "base_model_name": …}``; an empty one is skipped, as vLLM skips it (a
    launcher's unset variable). Raises ValueError on a malformed one, or on a JSON field vLLM
    does not take (a misspelt one would otherwise pass unnoticed)."""
    modules: dict[str, LoRARequest] = {}
    for value in values or ():
        if not value.strip():
            continue
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON ({e})") from None
            if (
                not isinstance(spec, dict)
                or not isinstance(spec.get("name"), str)
                or not isinstance(spec.get("path"), str)
            ):
                raise ValueError(f'--lora-modules {value!r}: the JSON form needs "name" and "path" strings')
            if unknown := sorted(set(spec) - _JSON_FIELDS):
                raise ValueError(f"--lora-modules {value!r}: unknown fields {unknown}")
            name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path")
            base = None
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = LoRARequest(name, next(_int_ids), path, base)
    return tuple(modules.values())


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


async def preload(engine: Any, modules: tuple[LoRARequest, ...]) -> None:
    """Serve the ``--lora-modules`` adapters (ValueError naming the first that cannot run)."""
    for module in modules:
        await engine.add_lora(module)


def lora_model_cards(state: Any) -> list[ModelCard]:
    """One card per adapter: ``root`` its directory, ``parent`` the base model (as vLLM lists them),
    the digest of its files that salts its KV blocks (routers key prompts with it), and whether it
    is served as ``--lora-modules`` named it (``lora_preloaded``: a router does not adopt those and
    load them onto replicas started without the flag) or from the resolver directory's entry of its
    name (``lora_resolved``: each replica with a resolver loads its own when named)."""
    preloaded = {(m.lora_name, m.lora_path) for m in state.config.lora_modules}
    resolver = getattr(state, "lora_resolver", None)
    served_names = (state.model_name, *state.config.model_aliases)
    return [
        ModelCard(
            id=name,
            root=served.request.lora_path,
            # vLLM takes a module's base_model_name only when it is a name the base is served by
            parent=b if (b := served.request.base_model_name) in served_names else state.model_name,
            max_model_len=state.limits.kv_capacity_tokens,
            lora_weights_id=served.weights_id,
            lora_preloaded=(name, served.request.lora_path) in preloaded,
            lora_resolved=resolver is not None and resolver.holds(name, served.request.lora_path),
        )
        for name, served in sorted(state.served_loras.items())
    ]


def _check_runtime(state: Any) -> None:
    if not getattr(state.engine.config, "enable_lora", False):
        raise bad_request("LoRA adapters are not enabled on this server (start it with --enable-lora)")
    if not runtime_updating_allowed(state.config.allow_runtime_lora_updating):
        raise APIError(
            404,
            "Loading and unloading LoRA adapters at run time is disabled (start the server with "
            f"--allow-runtime-lora-updating, or set {RUNTIME_UPDATING_ENV}=true).",
            code="not_found",
        )


async def load_lora_adapter(state: Any, req: LoadLoRAAdapterRequest) -> str:
    _check_runtime(state)
    name = req.lora_name
    if not name or not req.lora_path:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
    if name == state.model_name or name in state.config.model_aliases:
        raise bad_request(f"{name!r} is the base model's name", param="lora_name")
    try:
        served = await state.engine.add_lora(
            LoRARequest(name, next(_int_ids), req.lora_path), reload=req.load_inplace
        )
    except ValueError as e:
        if NO_ADAPTER in str(e):  # nothing there: vLLM's 404
            raise APIError(404, str(e), code="not_found", param="lora_path") from None
        raise bad_request(str(e), param="lora_path") from None
    if served is None:  # the engine decides, in turn with the name's other changes
        raise bad_request(
            f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
            "in place, set 'load_inplace' to True.",
            param="lora_name",
        )
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_lora_adapter(state: Any, req: UnloadLoRAAdapterRequest) -> str:
    _check_runtime(state)
    if not req.lora_name:
        raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
    if not await state.engine.remove_lora(req.lora_name):
        raise APIError(
            404, f"The lora adapter '{req.lora_name}' cannot be found.", code="not_found", param="lora_name"
        )
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
