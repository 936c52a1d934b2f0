"""`ferry up` gives the router its pools' ``--block-size`` (else the router keys 16-token blocks that
never match a 32-token worker's KV events), and refuses pools that would run different ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ferry.cluster.config import parse_config
from ferry.cluster.plan import build_plan
from ferry.cluster.spec import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _up_dry_run(tmp_path: Path, config: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [sys.executable, "-m", "ferry", "up", "--config", str(path), "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_router_gets_the_pools_block_size(tmp_path: Path) -> None:
    config = {
        "kv_tier": "redis://127.0.0.1:6379/0",
        "prefill": {"args": ["--block-size", "32"]},
        "decode": {"replicas": 2, "args": ["--block-size=32", "--max-num-seqs", "8"]},
    }
    done = _up_dry_run(tmp_path, config)
    assert done.returncode == 0, done.stderr
    (router,) = [line for line in done.stdout.splitlines() if " -m ferry router " in line]
    assert router.split()[-2:] == ["--block-size", "32"]
    # The router's own args may say the same (then ferry up adds nothing), never another size.
    same = {**config, "router": {"args": ["--block-size", "32"]}}
    argv = build_plan(parse_config(same), python="python").router.argv
    assert argv.count("--block-size") == 1 and argv[-2:] == ("--block-size", "32")
    # Pools without --block-size: the router keeps its default, as before.
    plain = build_plan(parse_config({"mixed": {}, "kv_tier": "memory://"}), python="python").router.argv
    assert "--block-size" not in plain


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"prefill": {"args": ["--block-size", "32"]}, "decode": {}},
            "decode.args: block size 16 (the default) differs from prefill's 32: every pool must run the"
            " same --block-size (the router hashes prompts with it)",
        ),
        (
            {"mixed": {"args": ["--block-size", "32"]}, "router": {"args": ["--block-size", "16"]}},
            "router.args: --block-size 16 differs from the workers' 32 (ferry up passes the workers' to the router)",
        ),
        (
            {"mixed": {"args": ["--block-size", "big"]}},
            "mixed.args: --block-size must be an integer, got 'big'",
        ),
    ],
)
def test_pools_of_different_block_sizes_are_refused(tmp_path: Path, config: dict, message: str) -> None:
    config = {"kv_tier": "redis://127.0.0.1:6379/0", **config}
    with pytest.raises(ConfigError) as e:
        parse_config(config)
    assert str(e.value) == message
    done = _up_dry_run(tmp_path, config)
    assert done.returncode == 2 and message in done.stderr


def test_a_pool_without_workers_does_not_count() -> None:
    config = {
        "kv_tier": "redis://127.0.0.1:6379/0",
        "mixed": {"replicas": 0, "args": ["--block-size", "64"]},
        "prefill": {"args": ["--block-size", "32"]},
        "decode": {"args": ["--block-size", "32"]},
    }
    assert parse_config(config).block_size == 32
