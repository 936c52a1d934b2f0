"""Sleep mode and weight updates over HTTP, for RL trainers colocated with the replica.

vLLM's routes (behind ``--enable-sleep-mode``): ``POST /sleep?level=1|2&mode=abort|wait|keep``,
``POST /wake_up`` (optionally ``?tags=weights&tags=kv_cache``), ``GET /is_sleeping`` ->
``{"is_sleeping": bool}``. SGLang's ``POST /update_weights_from_disk {"model_path", "load_format",
"abort_all_requests"}`` -> ``{"success": true, "message", "num_paused_requests"}`` (any replica;
errors in OpenAI's shape). The engine does the work between steps (``AsyncEngine.sleep`` and the
rest, engine/sleep_mode.py and engine/weight_update.py); this module only parses and answers.

A ``/sleep?mode=wait`` still waiting for running requests when a ``/wake_up`` comes is cancelled
(409, code ``sleep_cancelled``): the later call wins, the engine stays awake (engine/async_sleep.py).

While the engine sleeps ``/health`` stays 200, as vLLM's (the process is healthy; ``/is_sleeping``
says whether it serves), and generation requests wait until it wakes (vLLM holds them too).
"""

from __future__ import annotations

from typing import Any

from pydantic import StrictBool, StrictStr

from engine.errors import EngineDeadError, SleepCancelledError
from engine.sleep_mode import SLEEP_MODES, check_load_format, check_tags
from server.errors import APIError, bad_request, unavailable
from server.protocol import _Request


class UpdateWeightsFromDiskRequest(_Request):
    model_path: StrictStr
    load_format: StrictStr | None = None
    # SGLang's: abort running requests instead of letting them finish before the update.
    abort_all_requests: StrictBool = False


def _not_enabled() -> APIError:
    return bad_request(
        "Sleep mode is not enabled on this replica (start it with --enable-sleep-mode).",
        code="sleep_mode_disabled",
    )


def _parse_level(value: str | None) -> int:
    if value is None:
        return 1
    if value not in ("1", "2"):
        raise bad_request(f"level must be 1 or 2, got {value!r}", param="level")
    return int(value)


async def sleep(engine: Any, level: str | None, mode: str | None) -> None:
    if not engine.config.enable_sleep_mode:
        raise _not_enabled()
    lvl = _parse_level(level)
    mode = mode or "abort"
    if mode not in SLEEP_MODES:
        raise bad_request(f"mode must be one of {', '.join(SLEEP_MODES)}, got {mode!r}", param="mode")
    await engine_call(engine.sleep(lvl, mode))


async def wake_up(engine: Any, tags: list[str]) -> None:
    if not engine.config.enable_sleep_mode:
        raise _not_enabled()
    try:
        checked = check_tags(tags or None)
    except ValueError as e:
        raise bad_request(str(e), param="tags") from None
    await engine_call(engine.wake_up(list(checked)))


async def update_weights_from_disk(engine: Any, body: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
    try:
        check_load_format(body.load_format)
    except ValueError as e:  # here: the engine's other refusals are the checkpoint's (model_path)
        raise bad_request(str(e), param="load_format") from None
    aborted = await engine_call(
        engine.reload_weights(body.model_path, body.load_format, body.abort_all_requests), param="model_path"
    )
    return {
        "success": True,
        "message": f"Succeeded to update model weights from {body.model_path}.",
        "num_paused_requests": int(aborted),
    }


async def engine_call(call: Any, param: str | None = None) -> Any:
    try:
        return await call
    except ValueError as e:
        raise bad_request(str(e), param=param) from None
    except EngineDeadError as e:
        raise unavailable(f"The engine is not available: {e}") from None
    except SleepCancelledError as e:  # a /wake_up sent while this /sleep waited for requests wins
        raise APIError(409, f"Not asleep: {e}.", code="sleep_cancelled") from None
