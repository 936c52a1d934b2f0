"""Session-wide fixtures: tiny HF checkpoints (built once, offline) and a private redis-server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(models_root: Path) -> Path:
    """Llama with GQA (4 heads, 2 KV heads), untied embeddings."""
    from engine.demo import build_model

    return build_model(models_root / "llama", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_tied(models_root: Path) -> Path:
    from engine.demo import build_model

    return build_model(models_root / "llama_tied", "llama", seed=1, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama3_rope(models_root: Path) -> Path:
    """Llama with llama3 rope scaling."""
    from engine.demo import build_model

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return build_model(models_root / "llama3", "llama", seed=3, rope_scaling=scaling)


@pytest.fixture(scope="session")
def tiny_llama_yarn(models_root: Path) -> Path:
    """Llama with YaRN rope scaling (attention factor from the factor alone)."""
    from engine.demo import build_model

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    return build_model(models_root / "llama_yarn", "llama", seed=4, rope_scaling=scaling)


@pytest.fixture(scope="session")
def tiny_qwen2(models_root: Path) -> Path:
    """Qwen2 (q/k/v bias), GQA."""
    from engine.demo import build_model

    return build_model(models_root / "qwen2", "qwen2", seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3(models_root: Path) -> Path:
    """Qwen3 (per-head RMSNorm of q and k), GQA."""
    from engine.demo import build_model

    return build_model(models_root / "qwen3", "qwen3", seed=9)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(models_root: Path) -> Path:
    """Qwen3-MoE: 8 experts, 2 per token (normalised), layer 0 dense."""
    from engine.demo import build_model

    return build_model(models_root / "qwen3_moe", "qwen3_moe", seed=10)


@pytest.fixture(scope="session")
def tiny_phi3(models_root: Path) -> Path:
    """Phi-3: fused qkv_proj and gate_up_proj, partial rotary (0.75 of each head)."""
    from engine.demo import build_model

    return build_model(models_root / "phi3", "phi3", seed=12)


@pytest.fixture(scope="session")
def tiny_qwen2_moe(models_root: Path) -> Path:
    """Qwen2-MoE: 8 experts, 2 per token, a shared expert behind a sigmoid gate; layer 0 dense."""
    from engine.demo import build_model

    return build_model(models_root / "qwen2_moe", "qwen2_moe", seed=13)


@pytest.fixture(scope="session")
def tiny_gemma3(models_root: Path) -> Path:
    """Gemma 3 text: sliding (window 8) and full layers with their own rope (linear scaling on the
    full ones), sandwich norms, per-head q/k norm, GELU MLP, soft-capped logits."""
    from engine.demo import build_model

    return build_model(models_root / "gemma3", "gemma3", seed=14)


@pytest.fixture(scope="session")
def tiny_gemma3_mm(models_root: Path) -> Path:
    """A Gemma3ForConditionalGeneration checkpoint (language_model.* plus a vision tower), served text-only."""
    from engine.demo import build_model

    return build_model(models_root / "gemma3_mm", "gemma3_mm", seed=15)


@pytest.fixture(scope="session")
def tiny_mixtral(models_root: Path) -> Path:
    """Mixtral: 4 experts, 2 per token (block_sparse_moe.experts.N.w1/w2/w3)."""
    from engine.demo import build_model

    return build_model(models_root / "mixtral", "mixtral", seed=11)


@pytest.fixture(scope="session")
def tiny_deepseek(models_root: Path) -> Path:
    """DeepSeek-V3 (MLA: kv_lora_rank 16 + rope 8 cached per token; MoE: 8 experts in 2 groups,
    2 per token, 1 shared; layer 0 dense; a random score-correction bias); its tokenizer has
    DeepSeek's tool-call markers as tokens."""
    from engine.demo import build_model

    markers = (
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
    )
    return build_model(models_root / "deepseek", "deepseek_v3", seed=5, extra_tokens=markers)


@pytest.fixture(scope="session")
def tiny_deepseek_v2(models_root: Path) -> Path:
    """DeepSeek-V2 (softmax router, group_limited_greedy), MLA with query compression."""
    from engine.demo import build_model

    return build_model(models_root / "deepseek_v2", "deepseek_v2", seed=7)


@pytest.fixture(scope="session")
def tiny_deepseek_v2_lite(models_root: Path) -> Path:
    """DeepSeek-V2-Lite's shape: queries from one q_proj (no q_lora_rank), greedy top-k."""
    from engine.demo import build_model

    return build_model(models_root / "deepseek_v2_lite", "deepseek_v2_lite", seed=8)


@pytest.fixture(scope="session")
def tiny_deepseek_yarn(models_root: Path) -> Path:
    """DeepSeek-V3 with YaRN rope scaling (mscale_all_dim set, as DeepSeek-V3's own config)."""
    from engine.demo import build_model

    scaling = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    }
    return build_model(models_root / "deepseek_yarn", "deepseek_v3", seed=6, rope_scaling=scaling)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server on a free loopback port; can be stopped and restarted (same port)."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make test installs it)")
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--protected-mode",
                "no",
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def flush(self) -> None:
        import redis

        redis.Redis(port=self.port).flushall()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """One private redis-server for the session. Tests that share it call ``flush()`` first."""
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def private_redis(tmp_path: Path):
    """Starts more private redis-servers for one test (``private_redis(password=...)``); stops them after."""
    started: list[RedisServer] = []

    def start(password: str | None = None) -> RedisServer:
        workdir = tmp_path / f"redis-{len(started)}"
        workdir.mkdir()
        srv = RedisServer(workdir, password)
        started.append(srv)
        srv.start()
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.flush()
    return redis_server.url
