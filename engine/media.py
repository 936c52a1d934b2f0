"""Images named by URL in chat messages, fetched and decoded as vLLM does: ``data:image/…;base64,…``
URLs, ``http(s)://`` URLs (httpx, with a timeout and a byte limit; given ``allowed_media_domains``,
only from those hosts, redirects included), and ``file://`` paths only under
``allowed_local_media_path``. Torch-free; shared by the server (async) and ``LLM.chat`` (sync).

Every failure a client can cause is a ``MediaError`` (a ValueError) whose message says what was
wrong with which URL; the server answers it with a 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from engine.multimodal import SOURCE_DIGEST_KEY, open_image
from kvcache.keys import image_source_digest

# vLLM's VLLM_IMAGE_FETCH_TIMEOUT default is 5 s; a little more room for slow origins.
DEFAULT_FETCH_TIMEOUT = 10.0
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024


class MediaError(ValueError):
    """An image URL that cannot be read or decoded (a client error: HTTP 400)."""


@dataclass(frozen=True)
class MediaOptions:
    """``allowed_local_media_path``: the directory ``file://`` URLs may read under (vLLM's
    ``--allowed-local-media-path``); None refuses them. ``limit_images``: images one prompt may carry
    (vLLM's ``--limit-mm-per-prompt '{"image": N}'``; None: no limit)."""

    allowed_local_media_path: str | None = None
    limit_images: int | None = None
    # vLLM's --allowed-media-domains: the host names http(s) image URLs may name (redirects too);
    # None: any.
    allowed_media_domains: tuple[str, ...] | None = None
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES


def message_image_parts(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Each image content part's source, in message order: the URL of an ``image_url`` part (OpenAI
    chat: ``{"image_url": {"url": …}}`` or the URL alone), of an ``input_image`` part (Responses:
    ``image_url``), or a ``PIL.Image`` given in-process as ``{"type": "image_pil", "image_pil": …}``."""
    sources: list[Any] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            kind = part.get("type")
            if kind == "image_url":
                value = part.get("image_url")
                sources.append(value.get("url") if isinstance(value, Mapping) else value)
            elif kind == "input_image":
                sources.append(part.get("image_url"))
            elif kind == "image_pil":
                sources.append(part.get("image_pil"))
    return sources


def check_image_count(count: int, options: MediaOptions) -> None:
    if options.limit_images is not None and count > options.limit_images:
        raise MediaError(
            f"this request has {count} images, more than the {options.limit_images} allowed per prompt "
            "(--limit-mm-per-prompt)"
        )


def load_image(source: Any, options: MediaOptions) -> Any:
    """A decoded RGB ``PIL.Image`` for an image part's source (blocking: ``LLM.chat``)."""
    if not isinstance(source, str):
        return _given_image(source)
    scheme = _scheme(source)
    if scheme in ("http", "https"):
        import httpx

        check_domain(source, options)
        hooks = {"request": [lambda r: check_domain(str(r.url), options)]}
        # httpx's timeout bounds each read, not the fetch: an origin that trickles a byte now and
        # then would hold the caller forever. The whole fetch gets the limit, as vLLM's.
        deadline = time.monotonic() + options.fetch_timeout
        try:
            with (
                httpx.Client(
                    timeout=options.fetch_timeout, follow_redirects=True, event_hooks=hooks
                ) as client,
                client.stream("GET", source) as response,
            ):
                _check_status(source, response.status_code)
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    _check_size(source, len(data), options)
                    if time.monotonic() > deadline:
                        raise _too_slow(source, options)
        except httpx.HTTPError as e:
            raise MediaError(f"could not fetch image {_short(source)}: {type(e).__name__}") from None
        return _decode(source, bytes(data))
    return _decode(source, _local_bytes(source, scheme, options))


async def aload_image(source: Any, options: MediaOptions) -> Any:
    """``load_image`` for the server: the fetch does not block the event loop."""
    if not isinstance(source, str):
        return _given_image(source)
    scheme = _scheme(source)
    if scheme not in ("http", "https"):  # decoding a photo takes tens of ms: off the event loop
        return await asyncio.to_thread(lambda: _decode(source, _local_bytes(source, scheme, options)))
    import httpx

    check_domain(source, options)

    async def check_redirect(request: httpx.Request) -> None:
        check_domain(str(request.url), options)

    try:
        # The whole fetch, redirects and a trickling body included (httpx's timeout is per read).
        async with (
            asyncio.timeout(options.fetch_timeout),
            httpx.AsyncClient(
                timeout=options.fetch_timeout,
                follow_redirects=True,
                event_hooks={"request": [check_redirect]},
            ) as client,
            client.stream("GET", source) as response,
        ):
            _check_status(source, response.status_code)
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                _check_size(source, len(data), options)
    except httpx.HTTPError as e:
        raise MediaError(f"could not fetch image {_short(source)}: {type(e).__name__}") from None
    except TimeoutError:
        raise _too_slow(source, options) from None
    return await asyncio.to_thread(_decode, source, bytes(data))


def _given_image(source: Any) -> Any:
    from PIL import Image

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    raise MediaError("an image part needs a URL (image_url.url)")


def _scheme(url: str) -> str:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("http", "https", "data", "file"):
        raise MediaError(f"image URL {_short(url)}: only data:, http(s):// and file:// URLs are taken")
    return scheme


def check_domain(url: Any, options: MediaOptions) -> None:
    """``--allowed-media-domains``: refuse an http(s) URL (or a redirect) to any other host, before
    fetching (other sources pass)."""
    allowed = options.allowed_media_domains
    if allowed is None or not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
        return
    host = (urlparse(url).hostname or "").lower()
    if host not in allowed:
        raise MediaError(
            f"image URL {_short(url)}: {host or 'its host'} is not one of the server's allowed media domains "
            f"({', '.join(allowed)})"
        )


def _local_bytes(url: str, scheme: str, options: MediaOptions) -> bytes:
    if scheme == "data":
        return _data_url_bytes(url, options)
    root = options.allowed_local_media_path
    if root is None:
        raise MediaError("file:// image URLs need the server's --allowed-local-media-path")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"image URL {_short(url)}: a file:// URL names a local path")
    path = Path(unquote(parsed.path)).resolve()
    base = Path(root).resolve()
    if not path.is_relative_to(base):
        raise MediaError(f"image file {_short(url)} is outside the allowed local media path")
    try:
        size = path.stat().st_size
        _check_size(url, size, options)
        return path.read_bytes()
    except OSError as e:
        raise MediaError(f"could not read image file {_short(url)}: {type(e).__name__}") from None


def _data_url_bytes(url: str, options: MediaOptions) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError("a data URL image must be data:image/<type>;base64,<data>")
    if not header.startswith("image/"):
        raise MediaError(
            f"a data URL of type {header.removesuffix(';base64') or 'unknown'!r} is not an image"
        )
    # base64 is 4/3 of its bytes: refuse before decoding what could not fit.
    _check_size("data URL", len(payload) * 3 // 4, options)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL's base64 image data does not decode") from None


def _too_slow(url: str, options: MediaOptions) -> MediaError:
    return MediaError(f"could not fetch image {_short(url)} within {options.fetch_timeout:g} s")


def _check_status(url: str, status: int) -> None:
    if status >= 400:
        raise MediaError(f"could not fetch image {_short(url)}: HTTP {status}")


def _check_size(url: str, size: int, options: MediaOptions) -> None:
    if size > options.max_image_bytes:
        raise MediaError(f"image {_short(url)} is larger than {options.max_image_bytes} bytes")


def _decode(url: str, data: bytes) -> Any:
    """The decoded image, carrying its bytes' digest (``SOURCE_DIGEST_KEY``)."""
    try:
        image = open_image(data)
    except ValueError as e:
        raise MediaError(f"image {_short(url)}: {e}") from None
    image.info[SOURCE_DIGEST_KEY] = image_source_digest(data)
    return image


def _short(url: str) -> str:
    return repr(url if len(url) <= 80 else url[:77] + "...")
