"""What the PD tests share with their fixtures: the cluster's shape and the PD threshold."""

from __future__ import annotations

from dataclasses import dataclass

from tests.router.router_harness import Proc

PD_THRESHOLD = 16  # tokens: the tests' short prompts fall below it, the others above


@dataclass
class PDCluster:
    prefill: list[Proc]
    decode: list[Proc]
    mixed: Proc
    router: Proc  # --prefill P1 P2 --decode D1 D2
    slow_router: Proc  # --prefill P1 --decode D1 with a prefill timeout nobody meets
    mixed_router: Proc  # --prefill P1 --decode D1 --replica mixed
    procs: list[Proc]
