"""A replica removed from the router (admin DELETE, or discovery dropping it) while it still holds a
stream stays watched until that stream ends: when it then stops answering, its failed probes
eject it and the stream is cut and resumed on another replica at once, as for any replica, instead
of stalling until the read timeout (``--request-timeout``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from router_harness import Cluster, replicas_view, wait_until
from scripted_replica import DONE, GATE, HANG, ScriptedReplica, text_chunk


def _script(path: str, body: dict) -> list[bytes | str]:
    if body.get("resume"):
        return [text_chunk("b", 9, "length"), b"data: [DONE]\n\n", DONE]
    return [text_chunk("a", 7), text_chunk("a", 7), GATE, HANG]  # then the process hangs


def test_a_removed_replica_that_hangs_has_its_streams_cut_and_resumed(tmp_path: Path) -> None:
    replicas = [ScriptedReplica(), ScriptedReplica()]
    for r in replicas:
        r.script_for = _script
    cluster = Cluster(tmp_path, tmp_path)
    try:
        router = cluster.router(
            "--replica", replicas[0].url, "--replica", replicas[1].url, "--policy", "round_robin",
            "--request-timeout", "600",
        )  # fmt: skip
        assert wait_until(lambda: all(v["routable"] for v in replicas_view(router).values()), 60)
        body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 3}
        texts: list[str] = []
        released = 0.0
        # The client gives up long before the router's read timeout (10 min): a stall fails the test.
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                texts.append(json.loads(line[6:])["choices"][0]["text"])
                if len(texts) == 2:
                    (holder,) = [rep for rep in replicas if rep.bodies]
                    removed = httpx.request(
                        "DELETE", router.url + "/admin/replicas", json={"url": holder.url}, timeout=60
                    )
                    assert removed.status_code == 200
                    holder.release()  # it hangs now: silent stream, /health 503
                    released = time.monotonic()
        assert texts == ["a", "a", "b"]
        # Two failed probes at 0.2 s, then the cut: far below the read timeout, however loaded.
        assert time.monotonic() - released < 60
        (other,) = [rep for rep in replicas if rep is not holder]
        assert other.bodies[-1]["resume"] == {"token_ids": [7, 7]}
        assert holder.url not in replicas_view(router)
        assert "(removed, requests in flight): healthy -> ejected" in router.log.read_text()
    finally:
        cluster.close()
        for r in replicas:
            r.close()
