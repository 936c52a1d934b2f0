"""The load-balancer example and the dashboard against real processes on loopback:
nginx (deploy/nginx template) -> `ferry router` -> `ferry serve` (tiny Llama, KV tier in a private
Redis), all on free ports. A chat completion streams through the whole chain with the OpenAI SDK,
and every metric the Grafana dashboard queries is found in a live scrape of the replica or router.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from deploy_support import MODEL, ROOT, FerryProcess, free_port, nginx_binary, render_nginx_conf
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from ferry.cli import build_parser

DASHBOARD = ROOT / "deploy" / "grafana" / "ferry-dashboard.json"
METRIC_RE = re.compile(r"\b((?:vllm|ferry):[A-Za-z0-9_:]+)")


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def dashboard_metrics() -> set[str]:
    return {m for e in dashboard_exprs() for m in METRIC_RE.findall(e)}


def readme_metrics() -> set[str]:
    """Every metric name deploy/README.md names in inline code, brace groups expanded
    (`vllm:request_{prompt,generation}_tokens` is two names)."""

    def expand(token: str) -> list[str]:
        group = re.search(r"\{([^{}]*)\}", token)
        if group is None:
            return [token]
        head, tail = token[: group.start()], token[group.end() :]
        return [name for alt in group.group(1).split(",") for name in expand(head + alt + tail)]

    text = (ROOT / "deploy" / "README.md").read_text()
    return {
        name for token in re.findall(r"`((?:vllm|ferry):[A-Za-z0-9_:{},]+)`", text) for name in expand(token)
    }


def grouped_labels(expr: str) -> set[str]:
    """The labels a query aggregates by (`sum by (status) (…)`), less those the scrape adds."""
    groups = re.findall(r"\bby \(([^)]*)\)", expr)
    return {label.strip() for g in groups for label in g.split(",")} - {"pod", "namespace", ""}


def exported_labels(exposition: str) -> dict[str, set[str]]:
    """Series name -> the label names its samples carry."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def exported_names(exposition: str) -> set[str]:
    """Every series name a Prometheus scrape of this text can hold (declared families included)."""
    names: set[str] = set()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created")}
    for family in text_string_to_metric_families(exposition):
        names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


# ---------------------------------------------------------------- static checks (no processes)


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"
            assert 'namespace=~"$namespace"' in t["expr"], t["expr"]
    metrics = dashboard_metrics()
    # It covers each family ferry exports: replica (vLLM names), KV tier, router.
    assert {"vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket"} <= metrics
    assert any(m.startswith("ferry:kv_tier_") for m in metrics)
    assert any(m.startswith("ferry:router_") for m in metrics)


def nginx_site_directives() -> dict[str, list[str]]:
    """Directive -> values inside the template's `location /` block."""
    text = (ROOT / "deploy" / "nginx" / "ferry.conf.template").read_text()
    text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    block = re.search(r"location / \{(.*?)\n    \}", text, flags=re.S).group(1)
    out: dict[str, list[str]] = {}
    for stmt in block.split(";"):
        words = stmt.split()
        if words:
            out.setdefault(words[0], []).append(" ".join(words[1:]))
    out["gzip(server)"] = re.findall(r"^\s*gzip (\w+);", text, flags=re.M)
    out["client_max_body_size(server)"] = re.findall(r"^\s*client_max_body_size (\w+);", text, flags=re.M)
    return out


def test_nginx_template_is_sse_safe() -> None:
    d = nginx_site_directives()
    assert d["proxy_buffering"] == ["off"]
    assert d["proxy_cache"] == ["off"]
    assert d["proxy_http_version"] == ["1.1"]
    assert 'Connection ""' in d["proxy_set_header"]
    # Never end what a router (default flags) still serves in nginx's own 504 / 413 page: a stream
    # quiet for as long as the router waits on its replica, a body as large as the router takes.
    router = build_parser().parse_args(["router"])
    assert int(d["proxy_read_timeout"][0].rstrip("s")) >= router.request_timeout
    assert int(d["proxy_send_timeout"][0].rstrip("s")) >= router.request_timeout
    (body_size,) = d["client_max_body_size(server)"]
    assert int(body_size.rstrip("m")) << 20 >= max(router.max_request_bytes, router.max_file_bytes)
    assert d["gzip(server)"] == ["off"]
    assert (
        "non_idempotent" not in d["proxy_next_upstream"][0]
    )  # a POST that reached a router is never re-sent


def test_nginx_drops_idle_router_connections_before_the_router_does() -> None:
    """nginx reuses an idle connection to a router until its upstream keepalive_timeout; one the
    router closed meanwhile (its uvicorn keep-alive) can take a request as it closes: a 502."""
    from router.main import KEEP_ALIVE_S

    text = (ROOT / "deploy" / "nginx" / "ferry.conf.template").read_text()
    upstream = re.search(r"upstream ferry_routers \{(.*?)\n\}", text, flags=re.S).group(1)
    (timeout,) = re.findall(r"^\s*keepalive_timeout (\d+)s;", upstream, flags=re.M)
    assert int(timeout) < KEEP_ALIVE_S


def test_nginx_accepts_the_rendered_config(tmp_path: Path) -> None:
    binary = nginx_binary()
    conf = render_nginx_conf(tmp_path, free_port(), [free_port(), free_port()])
    proc = subprocess.run(
        [binary, "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert "syntax is ok" in proc.stderr and "test is successful" in proc.stderr


# ---------------------------------------------------------------- the live chain


def start_router(replica: FerryProcess, tiny_llama: Path, redis_url: str, logs: Path) -> FerryProcess:
    """A router configured as in the Kubernetes manifests: cache_aware with the model's tokenizer,
    following the replicas' KV block events in the tier."""
    args = [
        "--replica",
        replica.url,
        "--policy",
        "cache_aware",
        "--model",
        str(tiny_llama),
        "--kv-tier",
        redis_url,
    ]
    return FerryProcess("router", args, logs).start(timeout=60)


@pytest.fixture(scope="module")
def router(
    replica: FerryProcess, tiny_llama: Path, redis_server, deploy_logs: Path
) -> Iterator[FerryProcess]:
    proc = start_router(replica, tiny_llama, redis_server.url, deploy_logs)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def second_router(
    replica: FerryProcess, tiny_llama: Path, redis_server, deploy_logs: Path
) -> Iterator[FerryProcess]:
    proc = start_router(replica, tiny_llama, redis_server.url, deploy_logs)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def nginx(
    router: FerryProcess, second_router: FerryProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """nginx from deploy/nginx over two routers."""
    binary = nginx_binary()
    workdir = tmp_path_factory.mktemp("nginx")
    port = free_port()
    conf = render_nginx_conf(workdir, port, [router.port, second_router.port])
    proc = subprocess.Popen(
        [binary, "-p", str(workdir), "-c", str(conf), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            if proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {proc.stderr.read().decode()}")
            try:
                if httpx.get(url + "/nginx-health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            subprocess.run(["sleep", "0.1"], check=True)
        else:
            raise RuntimeError("nginx did not answer")
        yield url
    finally:
        proc.terminate()  # SIGTERM: nginx' fast shutdown
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_chat_completion_streams_through_nginx_router_replica(nginx: str, replica: FerryProcess) -> None:
    messages = [{"role": "user", "content": "Tell me about ferries and rivers."}]
    params = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0.0, seed=7)
    via_lb = OpenAI(base_url=nginx + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(
        via_lb.chat.completions.create(stream=True, stream_options={"include_usage": True}, **params)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    # One SSE event per token (not one buffered blob), ending with a finish reason and the usage.
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2
    assert finish == [finish[0]] and finish[0] in ("stop", "length")
    assert len(usage) == 1 and usage[0].completion_tokens >= len(content_chunks)
    # Exactly what the replica answers directly, greedy: nginx and the router changed nothing.
    direct = OpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert direct.chat.completions.create(**params).choices[0].message.content == text


def test_every_dashboard_metric_is_exported_live(
    nginx: str, replica: FerryProcess, router: FerryProcess
) -> None:
    # One request through the chain first, so per-request histograms and counters have samples.
    body = {"model": MODEL, "prompt": "ferry " * 40, "max_tokens": 4, "temperature": 0.0}
    assert httpx.post(nginx + "/v1/completions", json=body, timeout=120).status_code == 200
    replica_text = httpx.get(replica.url + "/metrics", timeout=10).text
    router_text = httpx.get(router.url + "/metrics", timeout=10).text
    from_replica, from_router = exported_names(replica_text), exported_names(router_text)
    wanted = dashboard_metrics()
    router_side = {m for m in wanted if m.startswith("ferry:router_")}
    assert router_side and router_side <= from_router, (
        f"not exported by the router: {router_side - from_router}"
    )
    replica_side = wanted - router_side
    assert replica_side <= from_replica, f"not exported by the replica: {replica_side - from_replica}"
    # What deploy/README.md tells operators to look for exists too.
    documented = readme_metrics()
    assert {"vllm:request_prompt_tokens", "ferry:kv_tier_put_seconds"} <= documented
    assert documented <= from_replica | from_router, (
        f"named in deploy/README.md, exported by nothing: {documented - from_replica - from_router}"
    )
    # A `sum by (label)` over a label the series lacks still returns one (unlabelled) series, so
    # a live Prometheus cannot catch it: check every grouping label against the scraped samples.
    labels = exported_labels(replica_text) | exported_labels(router_text)
    for expr in dashboard_exprs():
        wanted_labels = grouped_labels(expr)
        if not wanted_labels:
            continue
        carried = set().union(*(labels.get(m, set()) for m in METRIC_RE.findall(expr)))
        assert wanted_labels <= carried, f"{expr}: no {wanted_labels - carried} label on its series"


@pytest.fixture(scope="module")
def prometheus(
    replica: FerryProcess,
    router: FerryProcess,
    second_router: FerryProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """A real Prometheus scraping the replica and both routers every second, with the `namespace`
    and `pod` labels Kubernetes service discovery would attach."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "Prometheus is not installed (Debian: apt-get install prometheus): cannot evaluate the dashboard"
        )
    workdir = tmp_path_factory.mktemp("prometheus")
    targets = {"ferry-decode-0": replica, "ferry-router-0": router, "ferry-router-1": second_router}
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "ferry",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{p.port}"], "labels": {"namespace": "ferry", "pod": pod}}
                    for pod, p in targets.items()
                ],
            }
        ],
    }
    (workdir / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError("prometheus exited")
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError("prometheus did not become ready")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def promql(prom: str, query: str) -> list[dict]:
    resp = httpx.get(prom + "/api/v1/query", params={"query": query}, timeout=10).json()
    assert resp["status"] == "success", f"{query}: {resp}"
    return resp["data"]["result"]


def test_dashboard_and_autoscaling_queries_evaluate_on_live_data(nginx: str, prometheus: str) -> None:
    """Every dashboard query and the prometheus-adapter rule, run by a real Prometheus over scrapes
    of the live replica and routers: each parses, and each returns series."""
    client = OpenAI(base_url=nginx + "/v1", api_key="unused", max_retries=0, timeout=120)
    deadline = time.monotonic() + 60
    while True:  # traffic across several scrapes, so rate() and histogram_quantile() have data
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True))  # fmt: skip
        ready = promql(prometheus, "min(count_over_time(ferry:router_requests_total[1m]))")
        if ready and float(ready[0]["value"][1]) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    values = httpx.get(
        prometheus + "/api/v1/label/namespace/values",
        params={"match[]": "vllm:num_requests_running"},
        timeout=10,
    ).json()["data"]
    assert values == ["ferry"]  # the dashboard's namespace picker finds the deployment
    empty = []
    for expr in dashboard_exprs():
        if expr.startswith("label_values("):
            continue
        query = expr.replace("$namespace", "ferry").replace("$__rate_interval", "1m")
        if not promql(prometheus, query):
            empty.append(query)
    assert not empty, f"dashboard queries with no series: {empty}"

    rules = yaml.safe_load(
        (ROOT / "deploy/k8s/components/autoscaling/prometheus-adapter-rules.yaml").read_text()
    )
    for rule in rules["rules"]["custom"]:
        assert promql(prometheus, rule["seriesQuery"]), rule["seriesQuery"]
        series = rule["seriesQuery"].split("{")[0]
        query = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", 'namespace="ferry",pod=~"ferry-decode-0"')
            .replace("<<.GroupBy>>", "pod")
        )
        (row,) = promql(prometheus, query)
        assert row["metric"] == {"pod": "ferry-decode-0"}  # one value per pod, as the HPA reads it


def routed(router: FerryProcess) -> float:
    """Requests this router has finished (sum of ferry:router_requests_total over its labels)."""
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "ferry:router_requests_total"
    )


def test_nginx_balances_over_routers_and_skips_a_dead_one(
    nginx: str, router: FerryProcess, second_router: FerryProcess
) -> None:
    """Last in this module: it stops a router."""
    body = {"model": MODEL, "prompt": "a river", "max_tokens": 2, "temperature": 0.0}
    before = routed(router), routed(second_router)
    for _ in range(6):
        assert httpx.post(nginx + "/v1/completions", json=body, timeout=120).status_code == 200
    after = routed(router), routed(second_router)
    assert after[0] > before[0] and after[1] > before[1], (before, after)  # both routers got traffic
    assert sum(after) - sum(before) == 6

    second_router.stop()  # a router goes away: nginx tries the other one; no client sees an error
    for _ in range(4):
        assert httpx.post(nginx + "/v1/completions", json=body, timeout=120).status_code == 200
    assert routed(router) - after[0] == 4
