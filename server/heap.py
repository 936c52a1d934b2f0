"""The serving processes' heap after startup: ``settle_heap`` (``ferry serve``'s API server and
engine processes).

``ferry router`` keeps CPython's default threshold: the same change measured no gain there
(``bench/router.py --part overhead``, two runs each, alternating: 3,308 / 3,502 against 3,696 /
3,628 requests per second, 250 / 238 against 235 / 233 us of router CPU per request)."""

from __future__ import annotations

import gc

# CPython collects its youngest generation whenever 700 more tracked objects are alive than at the
# last collection. A burst's requests in flight are that many: traced on a 2-core VM (4 API servers,
# waves of 32 one-token streams), every API server collected once per wave, ~0.1 ms each in the
# middle of the burst's intake, and freed nothing (the objects were the requests themselves).
GC_YOUNG_THRESHOLD = 20_000


def settle_heap() -> None:
    """Once startup is done. What startup built (torch, the model, the app) lives as long as the
    process: out of the cyclic GC's view (``gc.freeze``), so collections of the oldest generation
    scan only what requests leave behind (a full collection over the startup heap took ~110 ms, a
    pause of the event loop and every stream). And the young generation is collected when
    ``GC_YOUNG_THRESHOLD`` objects more are alive, not 700: requests leave no reference cycles
    (``AsyncEngine``'s streams hold none), so its collections
    find little to free."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
