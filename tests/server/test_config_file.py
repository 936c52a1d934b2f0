"""`ferry serve --config FILE`: flags from YAML as `vllm serve --config`, the command line winning."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ferry.cli import build_parser, main
from ferry.config_file import expand_config
from server.args import add_serve_args
from tests.server.conftest import ServerProcess

CONFIG = """\
model: /models/a
port: 8001
max_model_len: 96
enable-prefix-caching: false
enable-lora: true
deterministic: false
served-model-name: [alpha, beta]
hf-overrides: {max_position_embeddings: 4096}
allowed-origins: ["https://a.example"]
seed: null
"""


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_entries_become_flags_before_the_command_line(tmp_path: Path) -> None:
    path = _write(tmp_path, CONFIG)
    argv = expand_config("serve", ["--config", path, "--port", "9000"], add_serve_args)
    assert argv == [
        "--model", "/models/a",
        "--port", "8001",
        "--max-model-len", "96",
        "--no-enable-prefix-caching",
        "--enable-lora",
        "--served-model-name", "alpha", "beta",
        "--hf-overrides", '{"max_position_embeddings": 4096}',
        "--allowed-origins", '["https://a.example"]',
        "--config", path, "--port", "9000",
    ]  # fmt: skip
    args = build_parser().parse_args(["serve", *argv])
    assert args.port == 9000 and args.max_model_len == 96 and args.enable_prefix_caching is False
    assert args.enable_lora is True and args.deterministic is False  # a false store_true: left out
    assert args.served_model_name == ["alpha", "beta"] and args.allowed_origins == ["https://a.example"]
    assert args.model == "/models/a" and args.seed == 0  # null: the default


def test_a_positional_model_wins_over_the_files(tmp_path: Path) -> None:
    path = _write(tmp_path, "model: /models/a\nport: 8001\n")
    assert expand_config("serve", ["/models/b", "--config", path], add_serve_args) == [
        "--port", "8001", "/models/b", "--config", path,
    ]  # fmt: skip
    # without one, the file's model is --model, which a later --model on the line replaces
    assert expand_config("serve", ["--config", path, "--model", "/m/c"], add_serve_args)[:2] == [
        "--model",
        "/models/a",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-modle-len: 96\n", "unknown option 'max-modle-len' (not a `ferry serve` flag)"),
        ("enable-lora: 3\n", "enable-lora is a switch: give it true or false, not 3"),
        ("- port\n- 8001\n", "the file must hold a mapping of flag names to values, not a list"),
        ("port: [8001\n", "not valid YAML"),
        ("config: other.yaml\n", "a config file cannot name another config file"),
        ("port: eighty\n", "argument --port: invalid int value: 'eighty'"),
    ],
)
def test_bad_files_are_named_errors(tmp_path: Path, capsys, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--config", path])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"ferry serve --config {path}: {message}" in err  # a bad value names the file too


def test_missing_file_is_named(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(tmp_path / "nope.yaml")])
    assert f"ferry serve --config {tmp_path / 'nope.yaml'}: " in capsys.readouterr().err


def test_run_batch_reads_its_flags_too(tmp_path: Path) -> None:
    from server.run_batch import add_run_batch_args

    path = _write(tmp_path, "input-file: in.jsonl\noutput_file: out.jsonl\nmax-num-seqs: 4\n")
    argv = expand_config("run-batch", ["--config", path], add_run_batch_args)
    args = build_parser().parse_args(["run-batch", *argv])
    assert (args.input_file, args.output_file, args.max_num_seqs) == ("in.jsonl", "out.jsonl", 4)


def test_serve_runs_from_a_config_file(tiny_llama: Path, serve_logs: Path, tmp_path: Path) -> None:
    path = _write(tmp_path, "served-model-name: [from-yaml]\nmax-model-len: 96\nport: 1\n")
    srv = ServerProcess(tiny_llama, ["--config", path], serve_logs).start()  # its --port wins over 1
    try:
        card = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
        assert (card["id"], card["max_model_len"]) == ("from-yaml", 96)
    finally:
        srv.stop()


@pytest.mark.parametrize(
    ("flag", "text", "value"),
    [
        ("--max-model-len", "32K", 32768),
        ("--max-model-len", "1k", 1000),
        ("--max-num-batched-tokens", "25.6k", 25600),
        ("--kv-cache-memory-bytes", "2G", 2 * 2**30),
        ("--max-request-bytes", "1m", 1_000_000),
        ("--max-model-len", "2048", 2048),
    ],
)
def test_size_flags_take_vllms_suffixes(flag: str, text: str, value: int) -> None:
    args = build_parser().parse_args(["serve", flag, text])
    assert getattr(args, flag[2:].replace("-", "_")) == value


@pytest.mark.parametrize("text", ["1.5K", "1.0001k", "32Q", "k", ""])
def test_bad_sizes_are_usage_errors(text: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", text])
    assert f"invalid integer {text!r}" in capsys.readouterr().err
