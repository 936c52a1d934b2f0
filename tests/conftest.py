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
# Triton's interpreter multiplies tiles with numpy, whose OpenBLAS picks a matrix kernel by CPU or
# by OPENBLAS_CORETYPE. The Haswell kernel (which one VM's environment sets) rounds a row
# differently by its place in the tile, so a kernel's batch invariance, a property of its fixed
# tiles on a GPU, fails there for the interpreter's sake alone (SkylakeX's and Nehalem's treat every
# row alike). One kernel for every machine: Nehalem's (SSE4.2, any x86-64). Set before numpy loads
# OpenBLAS; the tests' subprocesses inherit it.
os.environ["OPENBLAS_CORETYPE"] = "Nehalem"
# Servers and routers take an API key from these when no --api-key is given: the tests' processes
# (which inherit this environment) must not find one the developer set.
for _name in ("FERRY_API_KEY", "VLLM_API_KEY"):
    os.environ.pop(_name, None)


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


_DEEPSEEK_TOOL_MARKERS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# Fixture name -> (engine.demo.build_model architecture, seed, options). Each is built once per
# session into its own directory; engine/demo.py says what each architecture's tiny shape holds.
TINY_MODELS: dict[str, tuple[str, int, dict]] = {
    "tiny_llama": ("llama", 0, {}),  # GQA (4 heads, 2 KV heads), untied embeddings
    "tiny_llama_tied": ("llama", 1, {"tie_word_embeddings": True}),
    "tiny_qwen2": ("qwen2", 2, {}),  # q/k/v bias
    "tiny_llama3_rope": ("llama", 3, {"rope_scaling": _LLAMA3_ROPE}),
    "tiny_llama_yarn": ("llama", 4, {"rope_scaling": _YARN}),  # attention factor from the factor alone
    # DeepSeek-V3 (MLA: kv_lora_rank 16 + rope 8 cached per token; MoE: 8 experts in 2 groups, 2 per
    # token, 1 shared; layer 0 dense; a random score-correction bias); DeepSeek's tool-call markers
    # are tokens of its tokenizer.
    "tiny_deepseek": ("deepseek_v3", 5, {"extra_tokens": _DEEPSEEK_TOOL_MARKERS}),
    # YaRN with mscale_all_dim, as DeepSeek-V3's own config.
    "tiny_deepseek_yarn": (
        "deepseek_v3",
        6,
        {"rope_scaling": {**_YARN, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}},
    ),
    "tiny_deepseek_v2": ("deepseek_v2", 7, {}),  # softmax router, group_limited_greedy
    "tiny_deepseek_v2_lite": ("deepseek_v2_lite", 8, {}),  # one q_proj (no q_lora_rank), greedy top-k
    "tiny_qwen3": ("qwen3", 9, {}),  # per-head RMSNorm of q and k
    "tiny_qwen3_moe": ("qwen3_moe", 10, {}),  # 8 experts, 2 per token (normalised), layer 0 dense
    "tiny_mixtral": ("mixtral", 11, {}),  # 4 experts, 2 per token, block_sparse_moe.experts.N.w1/w2/w3
    "tiny_phi3": ("phi3", 12, {}),  # fused qkv_proj and gate_up_proj, partial rotary
    "tiny_qwen2_moe": ("qwen2_moe", 13, {}),  # a shared expert behind a sigmoid gate
    # Gemma 3 text: sliding and full layers with their own rope, sandwich norms, soft-capped logits.
    "tiny_gemma3": ("gemma3", 14, {}),
    "tiny_gemma3_mm": ("gemma3_mm", 15, {}),  # a Gemma3ForConditionalGeneration checkpoint, text-only
    "tiny_glm4_moe": ("glm4_moe", 16, {}),  # GLM-4.5: Llama-style attention, DeepSeek-V3-style MoE
    "tiny_granite": ("granite", 17, {}),  # Llama with four multipliers
    "tiny_gemma2": ("gemma2", 18, {}),  # soft-capped attention scores and logits, alternating windows
    "tiny_olmo2": ("olmo2", 19, {}),  # norms after each block, q/k norm over whole projections
    # gpt-oss: attention sinks, sliding (window 8) and full layers, biased router and experts, YaRN.
    "tiny_gpt_oss": ("gpt_oss", 23, {}),
    "tiny_seed_oss": ("seed_oss", 30, {}),  # Llama + q/k/v bias
    "tiny_olmo3": ("olmo3", 26, {}),  # OLMo 2 + a sliding (window 8) layer; rope scaled on the full one
    "tiny_smollm3": ("smollm3", 27, {}),  # layer 1 without rotary (NoPE)
    "tiny_glm4": ("glm4", 28, {}),  # sandwich norms, fused gate_up, half-rotary in interleaved pairs
    "tiny_ernie4_5": ("ernie4_5", 29, {}),  # rope over interleaved pairs (all dims)
    # ERNIE 4.5 MoE: 8 experts, 2 per token, chosen by softmax + correction bias; 1 shared; layer 0 dense.
    "tiny_ernie4_5_moe": ("ernie4_5_moe", 31, {}),
    "tiny_granitemoe": ("granitemoe", 32, {}),  # Granite's multipliers + 4 experts, 2 per token
    "tiny_exaone4": ("exaone4", 34, {}),  # a sliding layer with rotary, a full one without
    "tiny_hunyuan_dense": ("hunyuan_dense", 35, {}),  # q/k norm after rotary; NTK-alpha rope
    # MiniMax-M2: q/k norm over all heads, rotary_dim half the head, 4 experts by sigmoid + bias.
    "tiny_minimax_m2": ("minimax_m2", 36, {}),
    "tiny_arcee": ("arcee", 37, {}),  # an ungated ReLU^2 MLP
    "tiny_starcoder2": ("starcoder2", 38, {}),  # LayerNorms, biases everywhere, GELU MLP, window 8
    "tiny_cohere": ("cohere", 39, {}),  # parallel blocks, per-head q/k LayerNorm, interleaved rotary
    "tiny_cohere2": ("cohere2", 40, {}),  # + a sliding (window 8) layer and a full NoPE one
    "tiny_apertus": ("apertus", 41, {}),  # xIELU MLP (trained alphas), per-head q/k RMSNorm
    "tiny_dots1": ("dots1", 42, {}),  # q/k norm, V3-style MoE with unnormalised top-k; last layer slides
    "tiny_gemma": ("gemma", 33, {}),  # Gemma 1 (untied: tied, this tiny model barely reads attention)
    # Sequence classifiers (the decoder + a score head): three named labels; two on Gemma 2.
    "tiny_llama_cls": (
        "llama",
        20,
        {"num_labels": 3, "id2label": {0: "negative", 1: "neutral", 2: "positive"}},
    ),
    "tiny_gemma2_cls": ("gemma2", 22, {"num_labels": 2}),
}


def _tiny_model_fixture(name: str, arch: str, seed: int, options: dict):
    @pytest.fixture(scope="session", name=name)
    def build(models_root: Path) -> Path:
        from engine.demo import build_model

        return build_model(models_root / name.removeprefix("tiny_"), arch, seed=seed, **options)

    return build


for _name, (_arch, _seed, _options) in TINY_MODELS.items():
    globals()[_name] = _tiny_model_fixture(_name, _arch, _seed, _options)


# A cross-encoder's tokenizer places special tokens around a pair (BERT's [CLS] a [SEP] b [SEP]).
_PAIR_POST_PROCESSOR = {
    "type": "TemplateProcessing",
    "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}}],
    "pair": [
        {"Sequence": {"id": "A", "type_id": 0}},
        {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
        {"Sequence": {"id": "B", "type_id": 1}},
        {"SpecialToken": {"id": "<|im_end|>", "type_id": 1}},
    ],
    "special_tokens": {
        "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]},
        "<|im_end|>": {"id": "<|im_end|>", "ids": [2], "tokens": ["<|im_end|>"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):  # noqa: ANN201 - engine.tokenizer.Tokenizer
    """tiny_llama's tokenizer, as the engine reads it."""
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_llama)


@pytest.fixture(scope="session")
def tiny_cross_encoder(models_root: Path) -> Path:
    """A one-label Qwen3ForSequenceClassification (a reranker) whose tokenizer marks pairs with
    special tokens: ``a <|im_start|> b <|im_end|>``."""
    import json

    from engine.demo import build_model

    path = build_model(models_root / "cross_encoder", "qwen3", seed=21, num_labels=1)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["post_processor"] = _PAIR_POST_PROCESSOR
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


@pytest.fixture(scope="session")
def tiny_llava(models_root: Path) -> Path:
    """A LlavaForConditionalGeneration: a 2-layer CLIP vision tower (32x32 images in 8x8 patches:
    16 image tokens each, CLS dropped), the projector, the tiny Llama; ``<image>`` is token 1000."""
    from engine.demo import build_llava

    return build_llava(models_root / "llava", seed=24)


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
        deadline = time.monotonic() + 60
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
