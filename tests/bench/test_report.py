"""`ferry bench --compare` and `--report`: their files, and the HTML page in headless Chromium."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture
def two_runs(standin, bench, tmp_path: Path) -> tuple[Path, Path]:
    fast = standin("--tokens", "6")
    slow = standin("--tokens", "6", "--delay-ms", "5")
    dirs = []
    for name, srv in (("fast", fast), ("slow", slow)):
        out = tmp_path / name
        flags = (
            f"--base-url {srv.url} --num-prompts 6 --input-len 8 --output-len 6 --concurrency 1,2 "
            f"--label {name} --slo tpot=3"
        )
        rc, stdout = bench(flags, "--output-dir", str(out))
        assert rc == 0, stdout
        dirs.append(out)
    return dirs[0], dirs[1]


def test_compare_writes_side_by_side(two_runs, bench, tmp_path: Path) -> None:
    fast, slow = two_runs
    out = tmp_path / "cmp"
    rc, stdout = bench("--compare", str(fast / "summary.json"), str(slow), "--output-dir", str(out))
    assert rc == 0
    assert "compare c=1" in stdout and "compare c=2" in stdout and "slow/fast" in stdout
    data = json.loads((out / "compare.json").read_text())
    assert data["names"] == ["fast", "slow"] and set(data["points"]) == {"c=1", "c=2"}
    s_fast, s_slow = (json.loads((d / "summary.json").read_text()) for d in (fast, slow))
    row = data["points"]["c=2"]["TPOT median (ms)"]
    want = [
        p["metrics"]["tpot_ms"]["median"]
        for s in (s_fast, s_slow)
        for p in s["points"]
        if p["label"] == "c=2"
    ]
    assert row["values"] == want and row["ratios_to_first"] == [pytest.approx(want[1] / want[0])]
    # 5 ms per token against an instant stand-in: the slow run's TPOT is clearly larger.
    assert row["ratios_to_first"][0] > 2
    assert (out / "compare.txt").read_text().strip() == stdout.strip()


def test_report_writes_plots_and_html(two_runs, bench) -> None:
    fast, _ = two_runs
    rc, stdout = bench("--report", str(fast))
    assert rc == 0 and "report.html" in stdout
    for name in ("latency_cdf.png", "throughput_vs_load.png", "latency_vs_load.png"):
        assert (fast / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (fast / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "TTFT p99 (ms)" in page and "fast" in page


def test_report_without_matplotlib_says_what_to_install(bench, tmp_path: Path, monkeypatch) -> None:
    # A plain install (make serve) has no matplotlib: one line naming it, not a traceback.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, stdout = bench("--report", str(tmp_path))
    assert rc == 2 and "ferry bench: error:" in stdout and "pip install matplotlib" in stdout


class _CDP:
    """Chrome DevTools Protocol over --remote-debugging-pipe (fd 3 in, fd 4 out, NUL-framed JSON)."""

    def __init__(self) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def wire_fds() -> None:
            # Copy both ends above 4 first: a pipe end may already be fd 3 or 4, and dup2 onto
            # itself would keep its close-on-exec flag.
            src_in, src_out = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(src_in, 3)
            os.dup2(src_out, 4)

        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless=new",
                "--remote-debugging-pipe",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "about:blank",
            ],
            preexec_fn=wire_fds,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=False,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []

    def call(
        self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30
    ) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.events:
                if ev.get("method") == method:
                    return ev
            self.events.append(self._read(max(0.1, deadline - time.monotonic())))
            if time.monotonic() > deadline:
                raise TimeoutError(method)

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._from_chrome], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("no message from Chromium")
            data = os.read(self._from_chrome, 1 << 16)
            if not data:
                raise RuntimeError("Chromium closed the pipe")
            self._buf += data
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


@pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and shutil.which(CHROMIUM)),
    reason=f"headless Chromium is not installed at {CHROMIUM} (apt-get install chromium)",
)
def test_report_html_has_no_console_errors_in_chromium(two_runs, bench) -> None:
    fast, _ = two_runs
    assert bench("--report", str(fast))[0] == 0
    cdp = _CDP()
    try:
        target = cdp.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            cdp.call(f"{domain}.enable", session=session)
        cdp.call("Page.navigate", {"url": (fast / "report.html").as_uri()}, session=session)
        cdp.wait_event("Page.loadEventFired")
        images = cdp.call(
            "Runtime.evaluate",
            {
                "expression": "JSON.stringify(Array.from(document.images).map(i => [i.alt, i.naturalWidth]))",
                "returnByValue": True,
            },
            session=session,
        )["result"]["value"]
        title = cdp.call(
            "Runtime.evaluate", {"expression": "document.title", "returnByValue": True}, session=session
        )["result"]["value"]
    finally:
        cdp.close()
    errors = [
        ev
        for ev in cdp.events
        if ev.get("method") == "Runtime.exceptionThrown"
        or (ev.get("method") == "Runtime.consoleAPICalled" and ev["params"]["type"] in ("error", "assert"))
        or (ev.get("method") == "Log.entryAdded" and ev["params"]["entry"]["level"] == "error")
    ]
    assert errors == []
    widths = json.loads(images)
    assert len(widths) == 3 and all(w > 0 for _, w in widths)
    assert title == "ferry bench report: fast"
