"""Prompt keyers: shared text prefixes share leading hashes, token-id prompts are exact, no body raises."""

from __future__ import annotations

import hashlib

import pytest
from body_strategies import BODIES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.keys import block_hashes, image_source_digest
from router.prompt_keys import TEXT_CHUNK_CHARS, TextKeyer, TokenKeyer


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


@pytest.fixture(scope="module")
def keyers(tiny_llama) -> list:
    return [TextKeyer(16), TokenKeyer.from_dir(str(tiny_llama), 16)]


def test_truncated_prompts_key_the_tokens_the_replica_keeps(keyers) -> None:
    """``truncate_prompt_tokens`` keeps the prompt's last N tokens, or its first under vLLM's
    ``truncation_side: "right"``, as ``server.prompts.truncated`` does."""
    ids = list(range(40))
    token = keyers[1]
    kept = token.keys("/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 20})
    assert kept == (block_hashes(ids[-20:], 16), 20)
    body = {"prompt": ids, "truncate_prompt_tokens": 20, "truncation_side": "right"}
    assert token.keys("/v1/completions", body) == (block_hashes(ids[:20], 16), 20)


def test_a_text_part_that_is_not_text_gives_no_hint_not_an_error(keyers) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    for keyer in keyers:  # TextKeyer used to raise TypeError here: the router answered 500
        assert keyer.keys("/v1/chat/completions", body) == ([], 0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=BODIES,
    path=st.sampled_from(
        ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/inference/v1/generate"]
    ),
)
def test_keys_never_raise_on_any_body(keyers, body: dict, path: str) -> None:
    """Whatever a client sends, keying yields a routing hint or none; the replica judges the body."""
    for keyer in keyers:
        hashes, tokens = keyer.keys(path, body)
        assert isinstance(hashes, list) and all(isinstance(h, bytes) for h in hashes)
        assert isinstance(tokens, int) and tokens >= 0
        if not tokens:
            assert not hashes
        elif tokens >= 16:  # a block's worth (TextKeyer: ~4 characters per token, 64 per chunk)
            assert hashes


def test_responses_bodies_key_like_the_chat_body_the_replica_serves(keyers) -> None:
    body = {
        "instructions": "be brief " * 10,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello " * 30}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    }
    chat = {
        "messages": [
            {"role": "system", "content": "be brief " * 10},
            {"role": "user", "content": [{"type": "text", "text": "hello " * 30}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    }
    for keyer in keyers:
        got = keyer.keys("/v1/responses", body)
        assert got == keyer.keys("/v1/chat/completions", chat) and got[1] > 16
        assert keyer.keys("/v1/responses", {"input": 5}) == ([], 0)  # no hint, no error


def test_messages_bodies_key_like_the_chat_body_the_replica_serves(keyers) -> None:
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "be brief " * 10}],
        "messages": [
            {"role": "user", "content": "hello " * 30},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }
    chat = {
        "messages": [
            {"role": "system", "content": "be brief " * 10},
            {"role": "user", "content": "hello " * 30},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "ok"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "description": None, "parameters": {"type": "object"}},
            }
        ],
    }
    for keyer in keyers:
        got = keyer.keys("/v1/messages", body)
        assert got == keyer.keys("/v1/chat/completions", chat) and got[1] > 16
        assert keyer.keys("/v1/messages", {"messages": 5}) == ([], 0)  # no hint, no error


def test_generate_bodies_key_their_token_ids_as_the_completion_the_replica_runs(keyers) -> None:
    """vLLM's ``/inference/v1/generate``: its ``token_ids`` are the prompt, salted by its
    ``cache_salt`` and model as the completion ``completion_of`` makes of it."""
    from kvcache.keys import salt_extra

    ids = list(range(3, 43))
    path = "/inference/v1/generate"
    for keyer in keyers:
        body = {"token_ids": ids, "sampling_params": {"max_tokens": 4}, "model": "llama"}
        assert keyer.keys(path, body) == (block_hashes(ids, 16), 40)
        salted = keyer.keys(path, {**body, "cache_salt": "tenant-a"})
        assert salted == (block_hashes(ids, 16, salt_extra("tenant-a")), 40)
        assert salted == keyer.keys("/v1/completions", {"prompt": ids, "cache_salt": "tenant-a"})
        # A follow-up turn (the prompt extended) shares the first turn's blocks.
        longer = keyer.keys(path, {**body, "token_ids": [*ids, *range(100, 120)]})[0]
        assert longer[:2] == block_hashes(ids, 16) and len(longer) == 3
        for bad in ({"token_ids": []}, {"token_ids": ["a"]}, {"sampling_params": {}}, {"token_ids": 5}):
            assert keyer.keys(path, bad) == ([], 0)  # the replica answers its 400; no hint


def test_a_cache_salt_salts_every_key_as_the_replica_does() -> None:
    from kvcache.keys import salt_extra

    ids = list(range(40))
    for k in (TextKeyer(16),):
        salted, _ = k.keys("/v1/completions", {"prompt": ids, "cache_salt": "tenant-a"})
        assert salted == block_hashes(ids, 16, salt_extra("tenant-a"))
        assert salted != k.keys("/v1/completions", {"prompt": ids, "cache_salt": "tenant-b"})[0]
        assert salted[0] != block_hashes(ids, 16)[0]  # the first block already differs
        # A salt the replica would refuse (400) keys as no salt: only a routing hint is lost.
        assert k.keys("/v1/completions", {"prompt": ids, "cache_salt": 7})[0] == block_hashes(ids, 16)


@pytest.mark.parametrize("keyer", [TextKeyer(16), "token"])
def test_prompt_embeds_bodies_key_by_their_payload(keyer, tiny_llama) -> None:
    """The router never decodes embeddings: one hash of the payload, identical payloads alike,
    others apart, never a token or text hash; a body with only prompt_embeds does not break it."""
    k = TokenKeyer.from_dir(str(tiny_llama), 16) if keyer == "token" else keyer
    one = k.keys("/v1/completions", {"prompt": "", "prompt_embeds": "QUJD"})
    assert len(one[0]) == 1 and one[1] == 0
    assert k.keys("/v1/completions", {"prompt_embeds": ["QUJD", "REVG"]}) == one
    assert k.keys("/v1/completions", {"prompt_embeds": "REVG"})[0] != one[0]
    assert k.keys("/v1/completions", {"prompt": "QUJD"})[0] != one[0]
    assert k.keys("/v1/completions", {"prompt_embeds": "QUJD", "cache_salt": "s"})[0] != one[0]
    for bad in ([], [3], 5, ""):
        assert k.keys("/v1/completions", {"prompt_embeds": bad}) == ([], 0)


def test_image_chats_key_their_runs_by_the_images_bytes(tiny_llava) -> None:
    """Each image token becomes its placeholder run, keyed by the data URL's bytes; an image the
    router does not fetch (an http or file URL) by its URL, apart from any bytes' digest; the count
    covers every run."""
    from tests.server.test_llava_serve import data_url, image_message, png

    keyer = TokenKeyer.from_dir(str(tiny_llava), 16)
    assert keyer.image == (1000, 16)
    path = "/v1/chat/completions"
    ids = keyer.token_ids(path, {"messages": image_message(data_url(png(1)))})
    at = ids.index(1000)
    expanded = ids[:at] + [1000] * 16 + ids[at + 1 :]
    span = (at, 16, image_source_digest(png(1)))
    keys, count = keyer.keys(path, {"messages": image_message(data_url(png(1)))})
    assert keys == block_hashes(expanded, 16, images=[span]) and count == len(expanded)
    other, _ = keyer.keys(path, {"messages": image_message(data_url(png(2)))})
    assert other[: at // 16] == keys[: at // 16] and other[at // 16 :] != keys[at // 16 :]
    url = "http://127.0.0.1:9/a.png"
    by_url, count = keyer.keys(path, {"messages": image_message(url)})
    url_span = (at, 16, hashlib.blake2b(b"router-image-url\x00" + url.encode(), digest_size=16).digest())
    assert by_url == block_hashes(expanded, 16, images=[url_span]) and count == len(expanded)
    assert by_url[: at // 16] == keys[: at // 16] and by_url[at // 16 :] != keys[at // 16 :]
    assert keyer.keys(path, {"messages": image_message(url)}) == (by_url, count)  # a resent URL matches
    other_url, _ = keyer.keys(path, {"messages": image_message("file:///tmp/b.png")})
    assert other_url[: at // 16] == by_url[: at // 16] and other_url[at // 16 :] != by_url[at // 16 :]
    # a source that is neither (a data URL that does not decode): the keys end before the image
    broken, count = keyer.keys(path, {"messages": image_message("data:image/png;base64,@@@")})
    assert broken == block_hashes(ids[:at], 16) and count == len(expanded)
