"""The model's default sampling values (``generation_config.json``; vLLM's ``--generation-config``
and ``--override-generation-config``): which keys are read, which are not defaults, how overrides
and the sources combine, what is refused, and the offline ``LLM`` using them."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.generation_defaults import load_generation_defaults

QWEN = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def _dir(root: Path, name: str, config: dict | None) -> Path:
    path = root / name
    path.mkdir()
    if config is not None:
        (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_reads_the_sampling_keys_as_request_fields(tmp_path: Path) -> None:
    model = _dir(tmp_path, "m", {**QWEN, "max_new_tokens": 512, "eos_token_id": [1, 2], "min_p": 0.05})
    assert load_generation_defaults(model) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "min_p": 0.05,
        "max_tokens": 512,
    }


def test_values_equal_to_transformers_defaults_are_no_defaults(tmp_path: Path) -> None:
    # What transformers' to_diff_dict drops, vLLM never sees: top_k 50 is transformers' default.
    model = _dir(tmp_path, "m", {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0})
    assert load_generation_defaults(model) == {}
    assert load_generation_defaults(_dir(tmp_path, "none", None)) == {}
    assert load_generation_defaults(None) == {}


def test_sources_and_overrides(tmp_path: Path) -> None:
    model = _dir(tmp_path, "m", QWEN)
    other = _dir(tmp_path, "other", {"temperature": 0.3})
    assert load_generation_defaults(model, "vllm") == {}
    assert load_generation_defaults(model, "vllm", {"max_new_tokens": 8}) == {"max_tokens": 8}
    assert load_generation_defaults(model, str(other)) == {"temperature": 0.3}
    got = load_generation_defaults(model, "auto", '{"temperature": 0.2, "top_k": 50}')
    # An override is applied as given (top_k 50 included): it is no file read through transformers.
    assert got == {"temperature": 0.2, "top_p": 0.8, "top_k": 50, "repetition_penalty": 1.05}


@pytest.mark.parametrize(
    ("config", "source", "overrides", "message"),
    [
        ({"top_p": 0.0}, "auto", None, "top_p must be in (0, 1]"),
        ({"temperature": "hot"}, "auto", None, "temperature must be a number"),
        ({"top_k": 2.5}, "auto", None, "top_k must be a number"),
        ({"max_new_tokens": 0}, "auto", None, "max_tokens must be at least 1"),
        (QWEN, "auto", {"temperature": -1.0}, "--override-generation-config: temperature must be"),
        (QWEN, "auto", {"do_sample": False}, "unknown key(s) do_sample"),
        (QWEN, "auto", "{temperature", "is not valid JSON"),
        (QWEN, "auto", "[1]", "must be a JSON object"),
        (QWEN, "/nonexistent/dir", None, "no generation_config.json in that directory"),
    ],
)
def test_refusals_name_the_value(tmp_path: Path, config, source, overrides, message) -> None:
    model = _dir(tmp_path, "m", config)
    with pytest.raises(ValueError) as e:
        load_generation_defaults(model, source, overrides)
    assert message in str(e.value)


def test_garbled_file_is_refused(tmp_path: Path) -> None:
    model = _dir(tmp_path, "m", None)
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        load_generation_defaults(model)


def test_engine_config_parses_the_override_text() -> None:
    assert EngineConfig(override_generation_config='{"temperature": 0.5}').override_generation_config == {
        "temperature": 0.5
    }
    assert EngineConfig().override_generation_config is None
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(override_generation_config={"beams": 2})
    with pytest.raises(ValueError, match="generation_config must be"):
        EngineConfig(generation_config="")


def test_offline_llm_uses_the_models_defaults(tiny_llama: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **QWEN, "max_new_tokens": 6}))
    prompt = [5, 9, 14, 3, 22, 7]
    with LLM(str(model), num_kv_blocks=32, deterministic=True, num_threads=1) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.7, 0.8, 20)
        assert (defaults.repetition_penalty, defaults.max_tokens) == (1.05, 6)
        got = llm.generate([prompt], replace(defaults, seed=11, ignore_eos=True))[0].outputs[0]
        explicit = SamplingParams(
            temperature=0.7,
            top_p=0.8,
            top_k=20,
            repetition_penalty=1.05,
            max_tokens=6,
            seed=11,
            ignore_eos=True,
        )
        want = llm.generate([prompt], explicit)[0].outputs[0]
        neutral = llm.generate([prompt], SamplingParams(max_tokens=6, seed=11, ignore_eos=True))[0].outputs[0]
    assert len(got.token_ids) == 6 and got.token_ids == want.token_ids
    assert neutral.token_ids != want.token_ids
    # generate() without params takes the defaults: greedy and 4 tokens here, whatever the file says.
    overrides = {"temperature": 0.0, "max_new_tokens": 4}
    with LLM(str(model), num_kv_blocks=32, num_threads=1, override_generation_config=overrides) as llm:
        plain = llm.generate([prompt])[0].outputs[0]
        greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
    assert plain.token_ids == greedy.token_ids
    assert plain.finish_reason == greedy.finish_reason
    assert len(plain.token_ids) == 4 or plain.finish_reason == "stop"
