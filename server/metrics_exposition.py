"""The ``/metrics`` answer of a replica and of the router, in the format the scraper asks for, as
prometheus-client's own exposition app answers (vLLM mounts that app): the Prometheus text format
(``text/plain; version=0.0.4; charset=utf-8``) by default, OpenMetrics when the ``Accept`` header
asks for ``application/openmetrics-text`` (Prometheus does when its scrape protocols list it).

Imports nothing but prometheus-client, so the router uses it without the serving layer's modules.
"""

from __future__ import annotations

import functools
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
