"""The ``/metrics`` answer of a replica and of the router, in the format the scraper asks for, as
prometheus-client's own exposition app answers (vLLM mounts that app): the Prometheus text format
(``text/plain; version=0.0.4; charset=utf-8``) by default, OpenMetrics when the ``Accept`` header
asks for ``application/openmetrics-text`` (Prometheus does when its scrape protocols list it), and
gzip-compressed when the ``Accept-Encoding`` header takes gzip (Prometheus always sends it: a
replica's few hundred series shrink about tenfold).

Imports nothing but prometheus-client, so the router uses it without the serving layer's modules.
"""

from __future__ import annotations

import functools
import gzip
from collections.abc import Iterable, Iterator

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector


class Collectors(Collector):
    """Several registries exposed as one (a text exposition of each, concatenated, would not be
    valid OpenMetrics: that format ends once, with ``# EOF``)."""

    def __init__(self, collectors: Iterable[Collector]) -> None:
        self._collectors = tuple(collectors)

    def collect(self) -> Iterator[Metric]:
        for collector in self._collectors:
            yield from collector.collect()


def exposition(collector: Collector, accept: str | None) -> tuple[bytes, str]:
    """``collector``'s metrics in the format ``accept`` (the request's ``Accept`` header, None when
    it sent none) asks for, and that format's content type."""
    encoder, content_type = choose_encoder(accept or "")
    escaping = getattr(openmetrics, "ALLOWUTF8", None)  # (prometheus-client 0.22+, with escaping)
    if (
        content_type.startswith("application/openmetrics-text")
        and isinstance(encoder, functools.partial)
        and escaping
    ):
        # prometheus-client escapes a sample's name by the label-name rules, ``:`` included, but
        # its family's HELP and TYPE lines by the metric-name rules, which keep ``:``
        # (prometheus/client_python#1177): ``vllm_num_requests_running`` samples under
        # ``# TYPE vllm:num_requests_running``, a family a parser rejects or a name dashboards do
        # not query. Every name here is a legacy Prometheus name, which no escaping changes: so
        # render them unescaped, as the fixed library does.
        encoder = functools.partial(encoder, escaping=escaping)
    return encoder(collector), content_type


def content_encoding(body: bytes, accept_encoding: str | None) -> tuple[bytes, list[tuple[str, str]]]:
    """``body`` as sent to a client whose ``Accept-Encoding`` is ``accept_encoding`` (None: no such
    header), and the headers that say how: gzip when the client takes it (a coding listed with a
    ``q`` above zero, or ``*``), else as it is. Either way ``Vary: Accept-Encoding``, so a cache
    between scraper and server keeps the two apart."""
    vary = [("vary", "accept-encoding")]
    if not _takes_gzip(accept_encoding or ""):
        return body, vary
    # Level 6: prometheus-client's exposition app uses the module's default (9), which costs several
    # times the CPU for a few percent on text this repetitive.
    return gzip.compress(body, compresslevel=6, mtime=0), [("content-encoding", "gzip"), *vary]


def _takes_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` value accepts gzip (RFC 9110 §12.5.3: ``gzip`` or ``*``,
    without ``q=0``; an explicit ``gzip`` weight wins over ``*``'s)."""
    weights: dict[str, float] = {}
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        if not coding:
            continue
        weight = 1.0
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    weight = float(value.strip())
                except ValueError:
                    weight = 0.0
        weights[coding] = weight
    weight = weights.get("gzip", weights.get("x-gzip", weights.get("*", 0.0)))
    return weight > 0
