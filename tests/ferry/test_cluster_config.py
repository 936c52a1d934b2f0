"""The `ferry up` cluster file: exact validation errors, the default cluster, exact dry-run commands,
and what stops a start before anything runs (no redis-server, a port in use)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import yaml

from ferry.cli import main
from ferry.cluster.config import ClusterConfig, ConfigError, PoolSpec, load_config, parse_config
from ferry.cluster.plan import available_cpus, build_plan

REPO = Path(__file__).resolve().parents[2]

BAD_CONFIGS = [
    (
        "modle: x",
        "modle: unknown key, did you mean model? (expected one of: model, served_model_name, kv_tier,"
        " router, prefill, decode, mixed, env, drain_timeout, startup_timeout, restart, liveness)",
    ),
    (
        "router: {prot: 1}",
        "router.prot: unknown key, did you mean port? (expected one of: host, port, policy, args)",
    ),
    ("prefill: {replicas: two}", "prefill.replicas: expected an integer, got 'two' (str)"),
    ("mixed: {replicas: true}", "mixed.replicas: expected an integer, got True (bool)"),
    ("prefill: {}\ndecode: {replicas: -1}", "decode.replicas: must be >= 0, got -1"),
    ("mixed: {threads: 0}", "mixed.threads: must be >= 1 (or null for an even share of the cores), got 0"),
    ("router: {port: 70000}", "router.port: must be a port number 1-65535, got 70000"),
    (
        "router: {port: 9000}\nprefill: {port: 8999, replicas: 2}\ndecode: {}",
        "port clash: 9000 is used by router (router.port) and prefill-1 (prefill.port + 1)",
    ),
    (
        "prefill: {port: 9000, replicas: 2}\ndecode: {port: 9001}",
        "port clash: 9001 is used by prefill-1 (prefill.port + 1) and decode-0 (decode.port)",
    ),
    (
        "kv_tier: {redis: {port: 8080}}",
        "port clash: 8080 is used by router (router.port) and redis (kv_tier.redis.port)",
    ),
    (
        "mixed: {replicas: 0}",
        "no router targets: prefill.replicas, decode.replicas and mixed.replicas are all 0",
    ),
    (
        "prefill: {replicas: 2}",
        "prefill.replicas is 2 but decode.replicas is 0: a prefill pool needs a decode pool and a decode"
        " pool a prefill pool",
    ),
    (
        "router: {policy: fastest}",
        "router.policy: unknown policy 'fastest' (expected one of: round_robin, least_load, power_of_two,"
        " session, cache_aware)",
    ),
    (
        "kv_tier: http://cache:6379",
        "kv_tier: expected a URL redis://…, rediss://… or memory://, or a mapping {redis: {port: …}},"
        " got 'http://cache:6379'",
    ),
    (
        "kv_tier: memory://",
        "kv_tier: memory:// is private to each process; prefill and decode pools need a shared tier"
        " (redis://… or {redis: {…}})",
    ),
    ("kv_tier: {}", "kv_tier: expected a URL or {redis: {…}}, got an empty mapping"),
    ("kv_tier: {redis: {port: abc}}", "kv_tier.redis.port: expected an integer, got 'abc' (str)"),
    ("mixed: {args: --foo}", "mixed.args: expected a list of strings, got '--foo' (str)"),
    ("mixed: {args: [--port, 1]}", "mixed.args: --port is set by ferry up (use mixed.port)"),
    (
        "decode: {args: [--role=mixed]}\nprefill: {}",
        "decode.args: --role is set by ferry up (the pool is the role)",
    ),
    (
        "router: {args: [--prefill=http://x:1]}",
        "router.args: --prefill is set by ferry up (ferry up passes its prefill pool)",
    ),
    (
        "router: {args: [--uds, /tmp/router.sock]}",
        "router.args: --uds is set by ferry up (use router.host and router.port)",
    ),
    ("mixed: {env: {A: [1]}}", "mixed.env.A: expected a string, got [1] (list)"),
    ("env: [A]", "env: expected a mapping NAME: value, got ['A'] (list)"),
    ("drain_timeout: 0", "drain_timeout: must be > 0, got 0"),
    ("startup_timeout: .nan", "startup_timeout: must be > 0, got nan"),
    (
        "restart: {initial_delay: 5, max_delay: 2}",
        "restart.max_delay: must be >= restart.initial_delay (2 < 5)",
    ),
    ("- mixed", "the top level must be a mapping, got list"),
]


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS)
def test_bad_config_names_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(yaml.safe_load(text))
    assert str(e.value) == message


def test_pools_default_to_prefill_decode_until_the_file_names_one(tmp_path: Path) -> None:
    assert parse_config({"model": None}) == ClusterConfig()
    c = ClusterConfig()
    assert (c.prefill.replicas, c.decode.replicas, c.mixed.replicas) == (1, 1, 0)
    assert c.kv_tier.redis is not None and c.kv_tier.redis.port is None and c.router.port == 8080
    named = parse_config({"mixed": {"replicas": 3, "args": ["--max-num-seqs", 8]}, "kv_tier": "memory://"})
    assert named.mixed == PoolSpec("mixed", replicas=3, args=("--max-num-seqs", "8"))
    assert (named.prefill.replicas, named.decode.replicas) == (0, 0)
    assert parse_config({"mixed": None, "kv_tier": "memory://"}).mixed.replicas == 1
    # A relative model path is the cluster file's neighbour; a bare name that is no directory is a hub id.
    (tmp_path / "weights").mkdir()
    (tmp_path / "cluster.yaml").write_text("model: weights\n")
    assert load_config(tmp_path / "cluster.yaml").model == str((tmp_path / "weights").resolve())
    assert parse_config({"model": "org/some-model"}, tmp_path).model == "org/some-model"
    with pytest.raises(ConfigError, match=r"^model: no model directory at .*/missing$"):
        parse_config({"model": "./missing"}, tmp_path)


def test_example_cluster_file_is_valid() -> None:
    config = load_config(REPO / "deploy/local/cluster.yaml")
    assert (config.prefill.replicas, config.decode.replicas, config.mixed.replicas) == (1, 1, 0)
    assert config.kv_tier.redis is not None and config.router.port == 8080


def test_dry_run_prints_exact_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = tmp_path / "cluster.yaml"
    config.write_text(
        """
model: model
served_model_name: tiny
kv_tier: {redis: {port: 7001, maxmemory: 1gb}}
router: {host: 0.0.0.0, port: 7000, args: [--max-retries, 3]}
prefill: {threads: 2, port: 7100, args: [--block-size, 32]}
decode: {replicas: 2, threads: 3, port: 7200, env: {FOO: bar baz}, args: [--block-size, 32]}
env: {HF_HUB_OFFLINE: 1}
drain_timeout: 7.5
"""
    )
    assert main(["up", "--config", str(config), "--dry-run"]) == 0
    py, m = sys.executable, str(model.resolve())
    common = "PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1"
    serve = f"{py} -m ferry serve --host 127.0.0.1"
    redis = "redis://127.0.0.1:7001/0"
    tail = f"--drain-timeout 7.5 --model {m} --served-model-name tiny --kv-tier {redis} --kv-events --responses-store {redis}"
    assert capsys.readouterr().out.splitlines() == [
        "# ferry up --dry-run (ports left open in the file were picked now; a real run picks again)",
        "# redis: redis://127.0.0.1:7001/0",
        "redis-server --port 7001 --bind 127.0.0.1 --save '' --appendonly no --protected-mode no"
        " --maxmemory 1gb --maxmemory-policy allkeys-lru",
        "# prefill-0: http://127.0.0.1:7100",
        f"{common} OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 {serve} --port 7100 --role prefill --num-threads 2"
        f" {tail} --block-size 32",
        "# decode-0: http://127.0.0.1:7200",
        f"{common} OMP_NUM_THREADS=3 MKL_NUM_THREADS=3 FOO='bar baz' {serve} --port 7200 --role decode"
        f" --num-threads 3 {tail} --block-size 32",
        "# decode-1: http://127.0.0.1:7201",
        f"{common} OMP_NUM_THREADS=3 MKL_NUM_THREADS=3 FOO='bar baz' {serve} --port 7201 --role decode"
        f" --num-threads 3 {tail} --block-size 32",
        "# router: http://127.0.0.1:7000",
        f"{common} {py} -m ferry router --host 0.0.0.0 --port 7000 --policy cache_aware --drain-timeout 7.5"
        " --prefill http://127.0.0.1:7100 --decode http://127.0.0.1:7200 --decode http://127.0.0.1:7201"
        f" --kv-tier redis://127.0.0.1:7001/0 --model {m} --block-size 32 --max-retries 3",
        "# endpoint: http://127.0.0.1:7000/v1",
    ]


def test_otlp_traces_endpoint_reaches_every_worker_and_the_router(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ferry up --otlp-traces-endpoint URL`: each worker and the router get the flag (before their
    own args, so a pool's own flag wins) and an OTEL_SERVICE_NAME of their component, unless the
    file's env names one."""
    config = tmp_path / "cluster.yaml"
    config.write_text(
        """
kv_tier: redis://127.0.0.1:6379/0
router: {port: 7000}
prefill: {threads: 1, port: 7100}
decode: {threads: 1, port: 7200, env: {OTEL_SERVICE_NAME: my-decode}}
mixed: {threads: 1, port: 7300, args: [--otlp-traces-endpoint, http://other:4317]}
"""
    )
    url = "http://collector:4317"
    assert main(["up", "--config", str(config), "--dry-run", "--otlp-traces-endpoint", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = {lines[i][2:].split(":")[0]: lines[i + 1] for i in range(1, len(lines) - 1, 2)}
    assert sorted(commands) == ["decode-0", "mixed-0", "prefill-0", "router"]
    services = {name: line.split()[0] for name, line in commands.items()}
    assert services == {
        "prefill-0": "OTEL_SERVICE_NAME=ferry-prefill",
        "decode-0": "OTEL_SERVICE_NAME=my-decode",
        "mixed-0": "OTEL_SERVICE_NAME=ferry-mixed",
        "router": "OTEL_SERVICE_NAME=ferry-router",
    }
    plan = build_plan(
        parse_config(yaml.safe_load(config.read_text())), python="python", otlp_traces_endpoint=url
    )
    flags = {}
    for spec in plan.workers + (plan.router,):
        argv = list(spec.argv)
        flags[spec.name] = [argv[i + 1] for i, a in enumerate(argv) if a == "--otlp-traces-endpoint"]
    # argparse keeps the last: the mixed pool's own endpoint.
    assert flags == {
        "prefill-0": [url],
        "decode-0": [url],
        "mixed-0": [url, "http://other:4317"],
        "router": [url],
    }
    assert plan.router.argv[-2:] == ("--otlp-traces-endpoint", url)
    # Without the flag: no tracing flag, no service name.
    plain = build_plan(parse_config(yaml.safe_load(config.read_text())), python="python")
    assert "--otlp-traces-endpoint" not in plain.router.argv + plain.workers[0].argv
    assert "OTEL_SERVICE_NAME" not in {**plain.router.env, **plain.workers[0].env}


def test_an_otlp_endpoint_that_cannot_be_had_stops_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    config = tmp_path / "cluster.yaml"
    config.write_text("kv_tier: {redis: {binary: /nonexistent/redis-server}}\n")
    assert main(["up", "--config", str(config), "--otlp-traces-endpoint", "http://collector:4317"]) == 1
    assert capsys.readouterr().err == (
        "ferry up: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json' is not one of grpc, http/protobuf\n"
    )


def test_default_cluster_plan() -> None:
    from engine.demo import demo_model_path

    plan = build_plan(ClusterConfig(), python="python")
    prefill, decode = plan.workers
    assert plan.redis is not None and plan.kv_tier_url == plan.redis.url
    threads = str(max(1, available_cpus() // 2))
    assert prefill.argv == (
        "python", "-m", "ferry", "serve", "--host", "127.0.0.1", "--port", str(prefill.port),
        "--role", "prefill", "--num-threads", threads, "--drain-timeout", "30",
        "--kv-tier", plan.kv_tier_url, "--kv-events", "--responses-store", plan.kv_tier_url,
    )  # fmt: skip
    assert decode.argv[8:10] == ("--role", "decode") and prefill.env["OMP_NUM_THREADS"] == threads
    assert plan.router.argv == (
        "python", "-m", "ferry", "router", "--host", "127.0.0.1", "--port", "8080", "--policy", "cache_aware",
        "--drain-timeout", "30", "--prefill", prefill.url, "--decode", decode.url, "--kv-tier", plan.kv_tier_url,
        "--model", str(demo_model_path()),
    )  # fmt: skip
    ports = [plan.redis.port, prefill.port, decode.port, plan.router.port]
    assert len(set(ports)) == 4 and plan.endpoint == "http://127.0.0.1:8080"


def test_missing_redis_server_is_named_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text("kv_tier: {redis: {binary: /nonexistent/redis-server}}\n")
    assert main(["up", "--config", str(config)]) == 1
    assert capsys.readouterr().err.strip() == (
        "ferry up: /nonexistent/redis-server not found on PATH, and the KV tier is a redis-server that"
        " ferry up starts (kv_tier: {redis: …}, the default). Install Redis (Debian/Ubuntu: sudo apt-get"
        " install redis-server; Fedora: sudo dnf install redis; macOS: brew install redis), set"
        " kv_tier.redis.binary to its path, or use a Redis you already run (kv_tier: redis://HOST:6379/0)."
    )


def test_port_in_use_is_named_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = tmp_path / "cluster.yaml"
        config.write_text(f"kv_tier: memory://\nmixed: {{port: {port}}}\n")
        assert main(["up", "--config", str(config)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"ferry up: mixed.port: port {port} is already in use on 127.0.0.1 (another ferry up? choose"
        " another port)"
    )


@pytest.mark.parametrize("where", ["no-such-dir/state.json", "."])
def test_state_file_that_cannot_be_written_is_named_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """It was first written once Redis had started: a traceback, not a message."""
    config = tmp_path / "cluster.yaml"
    # `true` as the Redis binary: were anything started, it would be that and nothing heavier.
    config.write_text('model: no-such-org/no-such-model\nkv_tier: {redis: {binary: "true"}}\nmixed: {}\n')
    state = tmp_path / where
    assert main(["up", "--config", str(config), "--state-file", str(state)]) == 1
    problem = f"no directory {tmp_path / 'no-such-dir'}" if where != "." else "is a directory"
    assert capsys.readouterr() == ("", f"ferry up: --state-file {state}: {problem}\n")


def test_unreadable_and_invalid_files_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.yaml"
    assert main(["up", "--config", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ferry up: {missing}: cannot read {missing}: No such file or directory"
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text("router: {port: 1\n")
    assert main(["up", "--config", str(broken), "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(f"ferry up: {broken}: not valid YAML: ")
    typo = tmp_path / "typo.yaml"
    typo.write_text("mixed: {replicas: 1, thread: 2}\n")
    assert main(["up", "--config", str(typo)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ferry up: {typo}: mixed.thread: unknown key, did you mean threads? (expected one of: replicas,"
        " threads, port, args, env)"
    )


def test_restart_back_off_doubles_up_to_the_cap() -> None:
    from ferry.cluster.config import RestartSpec
    from ferry.cluster.supervisor import restart_delay

    spec = parse_config(
        {"mixed": {}, "kv_tier": "memory://", "restart": {"initial_delay": 0.5, "max_delay": 6}}
    ).restart
    assert spec == RestartSpec(initial_delay=0.5, max_delay=6.0, reset_after=60.0)
    assert [restart_delay(spec, n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 6.0, 6.0]


def test_api_key_is_masked_outside_the_dry_run() -> None:
    config = parse_config({"mixed": {}, "kv_tier": "memory://", "router": {"args": ["--api-key", "s3cret"]}})
    router = build_plan(config, python="python").router
    assert router.argv[-2:] == ("--api-key", "s3cret")  # what runs (and what --dry-run prints)
    assert router.redacted_argv()[-2:] == ("--api-key", "***")  # what the state file and errors show
    masked = build_plan(
        parse_config({"mixed": {}, "kv_tier": "memory://", "router": {"args": ["--api-key=s3cret"]}})
    ).router.redacted_argv()
    assert masked[-1] == "--api-key=***" and "s3cret" not in " ".join(masked)


def test_a_kv_tier_password_is_masked_outside_the_dry_run() -> None:
    tier = "rediss://ferry:s3cret@cache:6380/0"
    config = parse_config({"mixed": {"args": ["--register=redis://:hunter2@reg:6379/1"]}, "kv_tier": tier})
    plan = build_plan(config, python="python")
    worker, router = plan.workers[0], plan.router
    assert tier in worker.argv and tier in router.argv  # what runs (and what --dry-run prints)
    masked = "rediss://ferry:***@cache:6380/0"
    assert [a for a in worker.redacted_argv() if "://" in a] == [
        masked,  # --kv-tier
        masked,  # --responses-store
        "--register=redis://:***@reg:6379/1",
    ]
    assert [a for a in router.redacted_argv() if "@cache" in a] == [masked]
    assert not any("s3cret" in a or "hunter2" in a for p in plan.processes for a in p.redacted_argv())


def test_router_renders_chats_with_the_workers_chat_template() -> None:
    pools = {"args": ["--chat-template", "/t/chat.jinja", "--chat-template-content-format=openai"]}
    router = build_plan(parse_config({"mixed": pools, "kv_tier": "memory://"}), python="python").router
    assert router.argv[-4:] == (
        "--chat-template",
        "/t/chat.jinja",
        "--chat-template-content-format",
        "openai",
    )
    own = {"mixed": pools, "kv_tier": "memory://", "router": {"args": ["--chat-template", "/t/other.jinja"]}}
    router = build_plan(parse_config(own), python="python").router
    assert router.argv[-4:] == (
        "--chat-template-content-format",
        "openai",
        "--chat-template",
        "/t/other.jinja",
    )


def test_router_renders_chats_with_the_workers_template_defaults() -> None:
    pools = {
        "args": [
            "--default-chat-template-kwargs",
            '{"enable_thinking": false}',
            "--exclude-tools-when-tool-choice-none",
        ]
    }
    router = build_plan(parse_config({"mixed": pools, "kv_tier": "memory://"}), python="python").router
    assert router.argv[-3:] == (
        "--default-chat-template-kwargs",
        '{"enable_thinking": false}',
        "--exclude-tools-when-tool-choice-none",
    )


def test_router_reads_the_workers_tokenizer_directory(tmp_path: Path) -> None:
    """A pool's --tokenizer (vLLM's) is where the router reads its tokenizer from too; --uds is ferry up's."""
    pools = {"args": ["--tokenizer", str(tmp_path)]}
    router = build_plan(parse_config({"mixed": pools, "kv_tier": "memory://"}), python="python").router
    assert router.argv[router.argv.index("--model") + 1] == str(tmp_path)
    with pytest.raises(
        ConfigError, match=r"mixed.args: --uds is set by ferry up \(workers listen on mixed.port"
    ):
        parse_config({"mixed": {"args": ["--uds", "/tmp/x.sock"]}, "kv_tier": "memory://"})
