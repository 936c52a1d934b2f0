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


async def test_large_bodies_are_keyed_off_the_event_loop() -> None:
    """Tokenizing a long prompt must not stall the loop that relays every other stream."""
    import json
    import threading

    from router.prompt_keys import OFFLOAD_BYTES, prompt_keys

    class Recording(TextKeyer):
        threads: list[str] = []

        def keys(self, path, body):  # type: ignore[override]
            self.threads.append(threading.current_thread().name)
            return super().keys(path, body)

    k = Recording(16)
    small = {"prompt": "x" * 100}
    large = {"prompt": "y" * (OFFLOAD_BYTES + 1)}
    got_small = await prompt_keys(k, "/v1/completions", small, len(json.dumps(small)))
    got_large = await prompt_keys(k, "/v1/completions", large, len(json.dumps(large)))
    assert k.threads[0] == threading.current_thread().name  # small: inline
    assert k.threads[1] != threading.current_thread().name  # large: a worker thread
    assert got_small == TextKeyer(16).keys("/v1/completions", small)
    assert got_large == TextKeyer(16).keys("/v1/completions", large)
