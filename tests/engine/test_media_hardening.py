"""Images named in requests, read defensively. An image URL's fetch is bounded as a whole, as vLLM's
(aiohttp's total timeout): httpx's timeout bounds each read only, so an origin that sends a byte now
and then must not hold a request (and its server slot) for as long as it likes; a real loopback origin
trickles a valid PNG. Formats Pillow decodes with another program (EPS) are not opened."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from engine.media import MediaError, MediaOptions, aload_image, load_image


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()
STEP_S = 0.25  # between the trickled bytes: each read well inside the 1 s per-read timeout


class _Trickle(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = PNG if self.path == "/fast.png" else PNG[:24]  # the slow one: 24 bytes over ~6 s
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            if self.path == "/fast.png":
                self.wfile.write(body)
                return
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(STEP_S)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up, as it should

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


OPTIONS = MediaOptions(fetch_timeout=1.0)


def test_a_trickling_origin_is_cut_off_async(origin: str) -> None:
    assert asyncio.run(aload_image(f"{origin}/fast.png", OPTIONS)).size == (8, 6)
    with pytest.raises(MediaError) as e:
        asyncio.run(aload_image(f"{origin}/slow.png", OPTIONS))
    assert str(e.value) == f"could not fetch image '{origin}/slow.png' within 1 s"


def test_a_trickling_origin_is_cut_off_sync(origin: str) -> None:
    assert load_image(f"{origin}/fast.png", OPTIONS).size == (8, 6)
    with pytest.raises(MediaError) as e:
        load_image(f"{origin}/slow.png", OPTIONS)
    assert str(e.value) == f"could not fetch image '{origin}/slow.png' within 1 s"


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n%%EndComments\nshowpage\n%%EOF\n"


def test_eps_is_not_opened_from_a_request() -> None:
    """Pillow opens EPS and decodes it with Ghostscript: a request's bytes never get that far (the
    format is not tried, so the answer is the one for data that is no image at all)."""
    from engine.multimodal import open_image

    with pytest.raises(ValueError) as e:
        open_image(EPS)
    assert str(e.value) == "the data is not an image that can be decoded (UnidentifiedImageError)"
    assert open_image(PNG).size == (8, 6)
