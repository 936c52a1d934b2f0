"""Project-level invariants: the CLI assembles, and torch-free modules stay torch-free."""

from __future__ import annotations

import subprocess
import sys

from kvcache.keys import ROOT_HASH, block_hashes, extend_hashes, hash_block, tier_key


def test_ferry_cli_lists_subcommands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ferry", "--help"], capture_output=True, text=True, check=True
    )
    for sub in ("serve", "run-batch", "router", "up", "bench"):
        assert sub in out.stdout


def test_torch_free_modules_do_not_import_torch() -> None:
    code = (
        "import sys, engine, engine.sampling_params, engine.outputs, engine.config, engine.sleep_mode, kvcache.keys,"
        " server.sleep_mode, ferry.cli;"
        "ferry.cli.build_parser();"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_hash_chain_exact() -> None:
    toks = list(range(40))
    hs = block_hashes(toks, 16)
    assert len(hs) == 2  # the trailing 8 tokens are not a full block
    assert hs[0] == hash_block(ROOT_HASH, toks[:16])
    assert hs[1] == hash_block(hs[0], toks[16:32])
    # Pinned value: changing the encoding silently would split every deployed cache.
    assert hs[0].hex() == "5b21d45c0dd2214e680d2db1bc628f12"
    assert extend_hashes(hs[:1], toks, 16) == hs
    assert hash_block(ROOT_HASH, toks[:16], b"lora1") != hs[0]
    assert tier_key("abcd", hs[0]) == f"ferry:kv:abcd:{hs[0].hex()}"
