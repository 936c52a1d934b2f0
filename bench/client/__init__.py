"""The `ferry bench` client: datasets, load generation, streaming measurement, metrics, reports.

Layout: ``config`` (flags -> frozen BenchConfig), ``datasets/`` (request sets, one file a kind,
behind a registry), ``tokens`` (token sources used to build prompts of known length), ``sse`` and
``request`` (one streamed request, timed), ``load`` (arrivals, concurrency, warm-up, abort on a
lost server), ``metrics`` (summaries from raw records), ``table`` / ``compare`` / ``report``
(terminal tables, side-by-side comparison, plots + HTML), ``environment`` and ``output`` (what
gets written next to the numbers). Nothing here imports torch.
"""
