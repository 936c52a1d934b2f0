"""redis-py's own URL parameters in a tier URL reach redis-py with the values the user wrote.

The tier takes its own parameters (``ttl``, ``timeout``…) out of the URL and hands the rest to
redis-py; a value percent-encoded in the URL (``%2B`` for ``+``, ``%26`` for ``&``) must still be
that value there, not a space or a cut-off string.
"""

from __future__ import annotations

import redis
from redis.connection import parse_url

from kvcache.redis_tier import client_url
from kvcache.tier import open_tier


def test_encoded_client_name_reaches_redis(redis_url: str) -> None:
    tier = open_tier(redis_url + "?ttl=60&client_name=ferry%2Breplica")
    try:
        assert tier.put_many([("ferry:kv:fp:00", b"v")]) == [True]
        assert tier.get_many(["ferry:kv:fp:00"]) == [b"v"]
        assert tier.stats().errors == {}
        names = [c["name"] for c in redis.Redis.from_url(redis_url).client_list()]
        assert "ferry+replica" in names
    finally:
        tier.close()


def test_client_url_keeps_encoded_values() -> None:
    url = "rediss://cache:6380/2?ttl=60&ssl_ca_certs=/certs/a%2Bb%26c%25d.pem&client_name=x%2By"
    parsed = parse_url(client_url(url))
    assert parsed["ssl_ca_certs"] == "/certs/a+b&c%d.pem"
    assert parsed["client_name"] == "x+y"
    assert parsed["db"] == 2 and "ttl" not in parsed
