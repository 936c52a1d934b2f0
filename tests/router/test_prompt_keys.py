"""The text keyer (no tokenizer): shared text prefixes share leading hashes, token-id prompts are exact."""

from __future__ import annotations

from kvcache.keys import block_hashes
from router.prompt_keys import TEXT_CHUNK_CHARS, TextKeyer


def test_text_keys_follow_the_conversation_prefix() -> None:
    k = TextKeyer(16)
    system = {"role": "system", "content": "x" * (3 * TEXT_CHUNK_CHARS)}
    one, _ = k.keys("/v1/chat/completions", {"messages": [system, {"role": "user", "content": "a" * 100}]})
    two, _ = k.keys("/v1/chat/completions", {"messages": [system, {"role": "user", "content": "b" * 100}]})
    other, _ = k.keys("/v1/chat/completions", {"messages": [{"role": "system", "content": "y" * 300}]})
    assert len(one) == len(two) == 4
    assert one[:3] == two[:3] and one[3] != two[3]  # the system prompt's chunks are shared
    assert other[0] != one[0]


def test_token_id_prompts_hash_exactly_and_bad_bodies_give_nothing() -> None:
    k = TextKeyer(16)
    ids = list(range(40))
    assert k.keys("/v1/completions", {"prompt": ids}) == (block_hashes(ids, 16), 40)
    assert k.keys("/v1/chat/completions", {"messages": "nope"}) == ([], 0)
    assert k.keys("/v1/completions", {"prompt": 12}) == ([], 0)
