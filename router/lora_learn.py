"""What the router learns about LoRA adapters from the replicas' ``/v1/models``, beyond what was loaded
through it: a restarted router, or a second one in front of the same replicas, would otherwise know
only the adapters loaded through itself, and restore none of the others onto a replica that joins or
restarts.

Every ``/v1/models`` read of a replica (the prober's, every ``MODELS_REFRESH_S``, and a restore's) is
compared with the last read of the same engine instance (``Replica.lora_seen``). An adapter card is
one with a ``parent`` (the base model) and a ``root`` (the path it was loaded from), as vLLM and
``server/lora.py`` list them. The rules:

* *Another party's change.* An adapter that appeared on a replica, or changed its path, or went,
  while the replica kept running, and that this router did not send, was loaded or unloaded by
  another router or a client talking to the replica itself: the router follows it (the last word
  wins), taking the new path or forgetting the adapter. So two routers in front of the same replicas
  do not undo each other's work: one's unload is seen by the other, which then does not restore the
  adapter onto a replica that joins or restarts. A read that overlapped one of this router's own
  sends to the replica (``Replica.lora_changes`` / ``lora_changing``) is not compared; this
  router's own successful sends update the snapshot themselves.
* *Adoption.* An adapter a replica lists that the router does not know is adopted (name -> path;
  ``origin`` ``adopted`` in ``GET /admin/replicas``) and restored like one loaded through the
  router, unless: this router's last word on the name was an unload (a tombstone,
  ``router/lora_tombstones.py``: a client's through it, or another party's it saw) and no load was
  seen since; the replica is owed that name's unload (``Replica.lora_unloads``); another replica
  lists the name under a different path; or the replica serves it as its ``--lora-modules`` named it
  (a ferry card's ``lora_preloaded``): those come with the flag on every replica started with it,
  and loading them onto one started without it would undo a deliberate choice (or fail over and
  over where runtime loading is off). vLLM's cards do not tell them apart: a vLLM replica's
  ``--lora-modules`` adapters are adopted. An adapter found on a replica's first read (this router
  started, or the replica joined or restarted: one loaded by a router now gone, or one the replica
  kept) is adopted as a load through the router would have been: every replica the router has that
  does not list it is owed it, loaded at its next good probe (``LoraAdmin.owe``; the restore path,
  its backoff and ``op="restore"`` failures). One seen being loaded onto a running replica (another
  party's change) is followed, not spread: the replicas the router has that lack it are not given
  it (``adopted``) until they restart. Its loader spreads it (a router fans it out and restores it
  where that failed; a client that loaded it straight onto one replica chose that replica), and
  loading it as well would race that fan-out (its client would hear a replica's "already loaded")
  or bring back an adapter an unload crossed.
* *Resolved adapters are the replica's own.* An adapter a ferry replica serves from its
  ``--lora-resolver-dir`` entry of that name (its card's ``lora_resolved``) is loaded there again
  whenever a request names it, from that replica's own directory: it is neither followed nor
  adopted (adopted, it would be loaded onto every replica, from one replica's path, and a second
  replica resolving the name from its own directory would read as a conflict, or as a change of
  path that takes the first off the routing for it). vLLM's cards do not say so: its resolved
  adapters are taken as runtime loads.
* *An unload wins over adoption.* A restore's load of an adopted adapter first reads a replica that
  listed it, and loads nothing if that read shows it gone (an unload through another router seen in
  time). The replicas this router loaded an adopted adapter onto are remembered (``placed``): when
  it sees the adapter unloaded elsewhere, it sends them the unload too, so a load that crossed
  another router's unload is taken back rather than left there for the routers to adopt again.
* *Conflict.* One name under two paths (on two replicas, or a replica that comes with another path
  than the one the router adopted) is not adopted, or no longer: it is logged, counted once
  (``ferry:router_lora_failures_total{op="adopt"}``) and shown under ``conflicts`` until the replicas
  agree again. A replica listing the name under another path than the one the router knew it by
  (``Replica.lora_mismatch``) gets no request for it; with no known path (the conflict was there
  from the first reads) every replica listing it may. An adapter loaded through this router is no
  conflict: the router loads its path over another one on a replica that joins or restarts.

Limits: adoption cannot tell a replica that missed a load from one whose unload the router did not
see, and takes the first (an adapter unloaded straight from some replicas only, while no router that
reads them ran, is loaded back onto them when a router adopts it from another). An adapter whose
loader stopped before it reached every replica reaches the rest only as they restart or when a
router that finds it at a first read adopts it. A router that starts while another fans a load out
may load the adapter onto a replica first, and that replica then answers the other's client that it
is already loaded. Routers learn independently and only from the replicas each knows (each within
``MODELS_REFRESH_S`` and a probe of a change), so a replica that only one router knows can keep an
adapter another router unloaded (unload it again through that router). A change made while a
router is down is taken as adoption when it comes back, not as a change (an unload made then is
invisible to it: the replicas no longer list the adapter). This module must never import torch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from router.lora_tombstones import Tombstones
from router.replica import Replica

if TYPE_CHECKING:
    from router.lora_admin import LoraAdmin

log = logging.getLogger("ferry.router")


def adapter_cards(listed: Iterable[dict[str, Any]]) -> dict[str, str]:
    """The LoRA adapters among a replica's ``/v1/models`` entries: name -> the path it was loaded from."""
    return {
        m["id"]: m["root"]
        for m in listed
        if isinstance(m.get("parent"), str) and isinstance(m.get("root"), str) and m["root"]
    }


class LoraLearner:
    """Learns adapters from the replicas' lists into ``admin.adapters`` (module docstring)."""

    def __init__(self, admin: LoraAdmin) -> None:
        self.admin = admin
        # Of admin.adapters, those learned from replicas (not loaded through here): name -> the
        # replicas not given it until they restart (those lacking it when another party's load of
        # it was followed rather than spread).
        self.adopted: dict[str, set[Replica]] = {}
        # Adopted name -> the replicas this router loaded it onto: sent its unload when one is seen.
        self.placed: dict[str, set[Replica]] = {}
        self.tombstones = Tombstones(admin.app.clock)  # this router's last word on the name was an unload
        self.conflicts: dict[str, str | None] = {}  # name -> the path the router knew it by, if any
        self._failures = admin.app.metrics.lora_failures

    # ---- this router's own word -----------------------------------------------------------------
    def loaded(self, name: str, path: str) -> None:
        """A client loaded ``name`` through this router."""
        self.admin.adapters[name] = path
        self.adopted.pop(name, None)
        self.placed.pop(name, None)
        self.tombstones.discard(name)
        self.conflicts.pop(name, None)

    def unloaded_here(self, name: str) -> None:
        """A client unloaded ``name`` through this router: not adopted again until a load is seen."""
        self.admin.adapters.pop(name, None)
        self.adopted.pop(name, None)
        self.placed.pop(name, None)  # the unload goes to every replica
        self.tombstones.add(name, self.admin.app.replicas)
        self.conflicts.pop(name, None)

    def owes(self, replica: Replica, name: str) -> bool:
        """Whether a restore gives ``replica`` the remembered adapter ``name``."""
        return name in self.admin.adapters and replica not in self.adopted.get(name, ())

    def restarted(self, replica: Replica) -> None:
        """``replica`` restarted (or left): what it lists from now on is a fresh start."""
        replica.lora_seen = None
        replica.lora_mismatch = set()
        for spared in self.adopted.values():
            spared.discard(replica)
        for placed in self.placed.values():  # a restart drops what was loaded onto it
            placed.discard(replica)

    def place(self, replica: Replica, name: str) -> None:
        """A restore loaded ``name`` onto ``replica``: taken back if it was adopted and an unload is seen."""
        if name in self.adopted:
            self.placed.setdefault(name, set()).add(replica)

    @contextlib.contextmanager
    def sending(self, replica: Replica) -> Iterator[None]:
        """Around one of this router's load/unload sends to ``replica``: a read meanwhile is not compared."""
        replica.lora_changes += 1
        replica.lora_changing += 1
        try:
            yield
        finally:
            replica.lora_changing -= 1
            replica.lora_changes += 1

    def sent(self, replica: Replica, name: str, path: str | None, status: int) -> None:
        """The outcome of this router's send of ``name`` (``path``; None: an unload) to ``replica``."""
        if replica.lora_seen is None:
            return
        if status == 200:
            if path is None:
                replica.lora_seen.pop(name, None)
            else:
                replica.lora_seen[name] = path
        elif status >= 500:  # it may or may not have acted: the next read is a fresh start
            replica.lora_seen = None

    # ---- what the replicas say ------------------------------------------------------------------
    def observe(self, replica: Replica, listed: list[dict[str, Any]], token: int) -> None:
        """``replica``'s ``/v1/models`` entries, read when ``replica.lora_changes`` was ``token``."""
        if replica.removed or replica.lora_changes != token or replica.lora_changing:
            return
        cards = adapter_cards(listed)
        preloaded = {m["id"] for m in listed if m.get("lora_preloaded") is True}
        # Served from the replica's resolver directory (a ferry card's ``lora_resolved``): the
        # replica's own, loaded again whenever named, from its own directory (another replica's
        # path for the name is no conflict): neither followed nor adopted.
        resolved = {m["id"] for m in listed if m.get("lora_resolved") is True}
        own = {n: p for n, p in cards.items() if n not in resolved}
        seen, replica.lora_seen = replica.lora_seen, own
        if seen is not None:
            for name in sorted(seen.keys() | own.keys()):
                if seen.get(name) != own.get(name):
                    self._changed_elsewhere(replica, name, seen.get(name), own.get(name))
        for name, path in sorted(own.items()):
            self._consider(replica, name, path, name in preloaded)
        for name in list(self.conflicts):
            if len(self._paths(name)) < 2:
                log.info("LoRA adapter %r: the replicas agree on its path again", name)
                del self.conflicts[name]
        replica.lora_mismatch = {n for n, p in cards.items() if self._known(n) not in (None, p)}
        self.tombstones.sweep(self.admin.app.replicas)

    def _changed_elsewhere(self, replica: Replica, name: str, before: str | None, after: str | None) -> None:
        adapters = self.admin.adapters
        if after is None:
            if adapters.get(name) == before:
                log.info(
                    "LoRA adapter %r was unloaded from replica %s by another router or client: "
                    "not restored from now on",
                    name,
                    replica.url,
                )
                adapters.pop(name)
                self.adopted.pop(name, None)
                self._take_back(name, replica)
                self.tombstones.add(name, self.admin.app.replicas)
            return
        if adapters.get(name) == after:
            return
        log.info(
            "LoRA adapter %r was loaded onto replica %s from %s by another router or client: adopted",
            name,
            replica.url,
            after,
        )
        # Its loader spreads it (module docstring): loading it too would race that fan-out.
        self._adopt(name, after, spread=False)
        self.tombstones.discard(name)
        self.conflicts.pop(name, None)

    def _consider(self, replica: Replica, name: str, path: str, preloaded: bool) -> None:
        """Adopt ``name`` as ``replica`` lists it, or note the conflict it makes."""
        known = self.admin.adapters.get(name)
        if known == path or (known is not None and name not in self.adopted):
            return  # the router's own word: a replica with another path gets it at its restore
        if known is None and (preloaded or name in self.tombstones or name in replica.lora_unloads):
            return
        if name in self.conflicts:
            return
        paths = self._paths(name)
        if not paths:  # every replica that lists it lists this path (one that had the old one is gone)
            if preloaded:
                return
            log.info("LoRA adapter %r (%s) adopted from replica %s", name, path, replica.url)
            self._adopt(name, path, spread=True)
            return
        self.conflicts[name] = known
        self.admin.adapters.pop(name, None)
        self.adopted.pop(name, None)
        self._failures.labels("adopt").inc()
        log.warning(
            "LoRA adapter %r is listed under different paths (%s): not adopted, not restored onto "
            "any replica; requests for it go only to replicas listing %s",
            name,
            ", ".join(f"{url}: {p}" for url, p in sorted(paths.items())),
            known or "it",
        )

    def _adopt(self, name: str, path: str, spread: bool) -> None:
        """Restore ``name`` from ``path`` from now on; ``spread``: onto the replicas lacking it too."""
        self.admin.adapters[name] = path
        lacking = {r for r in self.admin.app.replicas if r.lora_seen is None or r.lora_seen.get(name) != path}
        self.adopted[name] = set() if spread else lacking
        if spread:
            self.admin.owe(lacking)

    def _take_back(self, name: str, seen_on: Replica) -> None:
        """``name`` was seen unloaded from ``seen_on``: unload it from the replicas this router loaded
        it onto (one load may have crossed the unload there)."""
        placed = self.placed.pop(name, set())
        placed.discard(seen_on)
        placed.intersection_update(self.admin.app.replicas)
        for r in placed:
            r.lora_unloads.add(name)
        if placed:
            log.info(
                "LoRA adapter %r: unloading it from the %d replica(s) this router loaded it onto too",
                name,
                len(placed),
            )
            self.admin.owe(placed)

    def _known(self, name: str) -> str | None:
        """The path the router knows ``name`` by (loaded, adopted, or the one before a conflict)."""
        return self.admin.adapters.get(name) or self.conflicts.get(name)

    def _paths(self, name: str) -> dict[str, str]:
        """url -> path of the replicas whose last read lists ``name``, when they differ (else {})."""
        paths = {
            r.url: r.lora_seen[name] for r in self.admin.app.replicas if r.lora_seen and name in r.lora_seen
        }
        return paths if len(set(paths.values())) > 1 else {}

    def view(self) -> dict[str, Any]:
        """For ``GET /admin/replicas``: what the router restores, and why it restores what it does not."""
        adapters = self.admin.adapters
        return {
            "adapters": {
                n: {"path": adapters[n], "origin": "adopted" if n in self.adopted else "loaded"}
                for n in sorted(adapters)
            },
            "unloaded": self.tombstones.names(),
            "conflicts": {n: self._paths(n) for n in sorted(self.conflicts)},
        }
