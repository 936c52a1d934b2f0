"""SM_FERRY_<SWITCH>=false on SageMaker: the switch's ``--no-`` form, never a positional model "false"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ferry.cli import build_parser, sagemaker_args
from server.main import check_serve_args

REPO = Path(__file__).resolve().parents[2]


def _parse(env: dict[str, str]):
    args = build_parser().parse_args(["serve", *sagemaker_args(env)])
    assert check_serve_args(args) is None
    return args


def test_false_turns_a_switch_off() -> None:
    env = {
        "SM_FERRY_MODEL": "/opt/ml/model",
        "SM_FERRY_ENABLE_PREFIX_CACHING": "false",  # on by default, with a --no- form
        "SM_FERRY_ENABLE_LORA": "False",  # a store_true switch: left out
        "SM_FERRY_DETERMINISTIC": "true",
    }
    assert sagemaker_args(env) == [
        "--host", "0.0.0.0", "--port", "8080",
        "--deterministic", "--no-enable-prefix-caching", "--model", "/opt/ml/model",
    ]  # fmt: skip
    args = _parse(env)
    assert args.model_tag is None and args.model == "/opt/ml/model"
    assert (args.enable_prefix_caching, args.enable_lora, args.deterministic) == (False, False, True)
    # true and an empty value still turn a switch on
    assert _parse({"SM_FERRY_ENABLE_PREFIX_CACHING": "TRUE"}).enable_prefix_caching is True
    assert _parse({"SM_FERRY_ENABLE_LORA": ""}).enable_lora is True


def test_a_switch_given_another_word_is_refused_naming_the_variable() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SM_FERRY_ENABLE_PREFIX_CACHING": "nope"}
    done = subprocess.run(
        [sys.executable, "-m", "ferry", "serve"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "SM_FERRY_ENABLE_PREFIX_CACHING='nope'" in done.stderr and "true or false" in done.stderr
