"""LoRA adapters loaded on first use from a directory: vLLM's filesystem LoRA resolver.

With ``--lora-resolver-dir DIR`` (or vLLM's ``VLLM_LORA_RESOLVER_CACHE_DIR``, see
``resolver_dir``), a request whose ``model`` names neither the base model nor an adapter served here
has adapter ``DIR/<model>`` loaded under that name (as ``POST /v1/load_lora_adapter`` would load it)
and runs with it; from then on it is served as any runtime load is: listed in ``/v1/models``, kept
in the engine's LoRA cache under ``--max-cpu-loras`` (evicted adapters are read again when named),
removed by ``/v1/unload_lora_adapter`` (the next request naming it loads it again).

What a name gets (vLLM's answers, where it has one):

* no entry ``DIR/<model>`` holding an ``adapter_config.json``: the 404 ``model_not_found`` a name
  not served gets without a resolver;
* a name that is not a plain relative path inside ``DIR`` (absolute, ``..``, ``.``, an empty part,
  a NUL, or a symbolic link whose target lies outside ``DIR``): 400, nothing read;
* an entry that cannot run on this base model (wrong shapes, a rank over ``--max-lora-rank``,
  unreadable files): 400 "LoRA adapter '<model>' was found but could not be loaded: <why>".
  vLLM's filesystem resolver instead skips, with a 404, an adapter whose ``base_model_name_or_path``
  is not the ``--model`` string; ferry checks what the adapter does to the model, not the name it
  was trained under (a hub id and a local copy of the same base differ as strings).

Concurrent requests naming one new adapter wait for one load (``_locks``: the first loads, the
others find it served); behind ``--api-server-count`` the engine takes the processes' loads of one
name in turn and reads the files once (``AsyncEngine.add_lora``). A refused entry is remembered
(``_refused``, the last ``REFUSED_MAX`` names) with a signature of its files (names, sizes,
modification times): a request for it while the files are unchanged gets the same 400 at the cost of
a directory listing, and changed files (an adapter fixed or replaced) are read again.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import OrderedDict
from typing import Any

from engine.keyed_locks import KeyedLocks
from engine.lora_request import LoRARequest
from server.errors import APIError, bad_request

log = logging.getLogger("ferry.server")

RESOLVER_DIR_ENV = "VLLM_LORA_RESOLVER_CACHE_DIR"
PLUGINS_ENV = "VLLM_PLUGINS"
PLUGIN_NAME = "lora_filesystem_resolver"
ADAPTER_CONFIG = "adapter_config.json"
REFUSED_MAX = 1024
# vLLM's resolved adapters take ids from its own counter; ferry's loads take theirs above the
# --lora-modules ones (server/lora.py counts from 1): the id names nothing outside the engine.
_int_ids = itertools.count(1 << 30)


def resolver_dir(flag: str | None, environ: Any = os.environ) -> str | None:
    """The directory adapters are resolved from: ``--lora-resolver-dir``, else vLLM's
    ``VLLM_LORA_RESOLVER_CACHE_DIR`` when vLLM would load its filesystem resolver plugin
    (``VLLM_PLUGINS`` unset, as vLLM then loads every installed plugin, or naming
    ``lora_filesystem_resolver``). Raises ValueError if it is not a directory (as vLLM does)."""
    directory = flag
    source = "--lora-resolver-dir"
    if directory is None:
        plugins = environ.get(PLUGINS_ENV)
        wanted = plugins is None or PLUGIN_NAME in [p.strip() for p in plugins.split(",")]
        directory = (environ.get(RESOLVER_DIR_ENV) or None) if wanted else None
        source = RESOLVER_DIR_ENV
    if directory is None:
        return None
    if not os.path.isdir(directory):
        raise ValueError(f"{source} {directory!r} is not a directory")
    return os.path.realpath(directory)


class LoRAResolver:
    """Resolves adapter names from one directory for one API server process (``ServerState.resolve_model``)."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.realpath(directory)
        self._locks = KeyedLocks()
        self._refused: OrderedDict[str, tuple[tuple, str]] = OrderedDict()

    def entry(self, name: str) -> str | None:
        """``DIR/<name>`` if it holds an adapter (None: nothing there); APIError 400 for a name that
        would reach outside the directory."""
        parts = name.replace("\\", "/").split("/")
        if "\x00" in name or os.path.isabs(name) or any(p in ("", ".", "..") for p in parts):
            raise _outside(name)
        path = os.path.join(self.directory, *parts)
        real = os.path.realpath(path)
        if not real.startswith(self.directory + os.sep):
            raise _outside(name)
        return path if os.path.isfile(os.path.join(real, ADAPTER_CONFIG)) else None

    def holds(self, name: str, path: str) -> bool:
        """Whether adapter ``name`` served from ``path`` is this directory's entry of its name (what
        a request naming it would load here, by whom ever it was loaded)."""
        try:
            entry = self.entry(name)
        except APIError:
            return False
        return entry is not None and os.path.realpath(entry) == os.path.realpath(path)

    async def resolve(self, engine: Any, name: str, served: Any) -> bool:
        """Serve adapter ``name`` from the directory if it holds one (False: it does not). ``served``
        gives the adapters served now (an API server's view). APIError 400 if the entry cannot run."""
        path = self.entry(name)
        if path is None:
            return False
        async with self._locks.hold(name):
            if name in served():
                return True  # another request's load, while this one waited
            signature = _signature(path)
            refused = self._refused.get(name)
            if refused is not None and refused[0] == signature:
                raise _unloadable(name, refused[1])
            self._refused.pop(name, None)
            log.info("Loading LoRA adapter %r from the resolver directory (%s)", name, path)
            try:
                added = await engine.add_lora(LoRARequest(name, next(_int_ids), path))
            except ValueError as e:
                self._refused[name] = (signature, str(e))
                while len(self._refused) > REFUSED_MAX:
                    self._refused.popitem(last=False)
                log.warning("LoRA adapter %r in the resolver directory could not be loaded: %s", name, e)
                raise _unloadable(name, str(e)) from None
            if added is not None:  # None: another API server's load of the name came first
                log.info("Resolved LoRA adapter %r from %s", name, path)
            return True


def _signature(path: str) -> tuple:
    """What changes when an adapter's files do: each file's name, size and modification time."""
    try:
        with os.scandir(path) as it:
            return tuple(sorted((e.name, (s := e.stat()).st_size, s.st_mtime_ns) for e in it if e.is_file()))
    except OSError:
        return ()


def _outside(name: str) -> APIError:
    return bad_request(
        f"The model `{name}` cannot be resolved as a LoRA adapter: the name must be a relative path "
        "inside the resolver directory (no absolute path, '.', '..' or link out of it).",
        param="model",
    )


def _unloadable(name: str, why: str) -> APIError:
    return bad_request(f"LoRA adapter '{name}' was found but could not be loaded: {why}", param="model")
