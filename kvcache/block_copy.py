"""The tensor side of the KV connector: one block's layout, and its copies between the engine's
paged cache and host memory.

A stored block is ``block_shape = (num_layers, parts, block_size, num_kv_heads, head_dim)``: two
parts per layer (K and V) or one (MLA's latent, passed as the K caches with no V caches). The paged
caches are per layer ``[num_blocks, block_size, num_kv_heads, head_dim]`` (ARCHITECTURE.md).

Nothing here talks to a tier or counts anything: ``kvcache/tier_reads.py`` fetches and decodes what
``copy_in`` lands, ``kvcache/connector.py`` queues what ``snapshot`` copies out.

The work is memcpy-shaped: one thread already outruns the network, while an OpenMP team competing
with the model's own team (or other processes) stalls on every op (10x slower measured on a loaded
2-core box). With the OpenMP backend the thread count is a per-thread setting, so both copies lower
it for their own work alone (``engine/torch_threads.py``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from engine.torch_threads import this_thread_count

LOAD_CHUNK = 64  # blocks per tier read: long prefixes stream in chunks and stop at a miss early
STAGING_BYTES = 32 << 20  # cap of one thread's host staging buffer (bounds LOAD_CHUNK for big blocks)


class BlockCopier:
    """Copies whole blocks in (``copy_in``) and out (``snapshot``); thread-safe (per-thread staging)."""

    def __init__(self, block_shape: Sequence[int], dtype: torch.dtype) -> None:
        shape = tuple(int(d) for d in block_shape)
        if len(shape) != 5 or shape[1] not in (1, 2) or min(shape) <= 0:
            raise ValueError(
                "block_shape must be (num_layers, parts, block_size, num_kv_heads, head_dim) with 2 parts "
                f"(K, V) or 1 (a latent), got {block_shape}"
            )
        self.block_shape = shape
        self.dtype = dtype
        self.num_layers = shape[0]
        self.num_parts = shape[1]
        self.block_bytes = math.prod(shape) * dtype.itemsize
        self.load_chunk = max(1, min(LOAD_CHUNK, STAGING_BYTES // self.block_bytes))
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._local = threading.local()

    def check(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        """Refuse caches of another layout than ``block_shape`` and ``dtype`` (a misuse: ValueError)."""
        num_v = self.num_layers if self.num_parts == 2 else 0
        if len(k_caches) != self.num_layers or len(v_caches) != num_v:
            raise ValueError(
                f"expected {self.num_layers} K and {num_v} V caches, got {len(k_caches)} and {len(v_caches)}"
            )
        k = k_caches[0]
        if k.dtype != self.dtype or tuple(k.shape[1:]) != self.block_shape[2:]:
            raise ValueError(
                f"cache layout {tuple(k.shape[1:])}/{k.dtype} does not match the connector's "
                f"{self.block_shape[2:]}/{self.dtype}"
            )

    # ---- in: decoded blocks into the paged cache ----------------------------------------------

    def copy_in(
        self,
        blocks: list[torch.Tensor],
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> None:
        """Copy at most ``load_chunk`` decoded blocks into ``block_ids``; done when it returns."""
        device = k_caches[0].device
        on_gpu = device.type == "cuda"
        with this_thread_count(1):
            # One copy into a reused host staging buffer (fresh buffers cost page faults that take
            # longer than the copy itself), then 2 x num_layers index_copy_ calls for the whole
            # chunk instead of 2 x num_layers per block.
            staging = self._staging_buffer(len(blocks), pinned=on_gpu)
            torch.stack(blocks, out=staging)  # [n, layers, 2, block_size, kv_heads, head_dim]
            if on_gpu:
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):
                    self._scatter(staging.to(device, non_blocking=True), block_ids, k_caches, v_caches)
                stream.synchronize()  # blocks usable by any stream once load() returns; staging reusable
            else:
                self._scatter(staging, block_ids, k_caches, v_caches)

    def _staging_buffer(self, n: int, *, pinned: bool) -> torch.Tensor:
        """A per-thread host buffer of ``load_chunk`` blocks (load and load_async may overlap)."""
        buf = getattr(self._local, "staging", None)
        if buf is None:
            buf = torch.empty((self.load_chunk, *self.block_shape), dtype=self.dtype, pin_memory=pinned)
            self._local.staging = buf
        return buf[:n]

    def _scatter(
        self,
        staging: torch.Tensor,
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> None:
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=staging.device)
        for layer in range(self.num_layers):
            for part, cache in enumerate(self._parts(layer, k_caches, v_caches)):
                cache.index_copy_(0, ids, staging[:, layer, part])

    # ---- out: a host copy of blocks to write -------------------------------------------------

    def snapshot(
        self, block_ids: Sequence[int], k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """``[n, *block_shape]`` host copy of the blocks (synchronous: a slot may be reused right after)."""
        with this_thread_count(1):
            if len(block_ids) == 1:  # the common per-block case: views and a single stack
                b = block_ids[0]
                parts = [
                    t[b] for layer in range(self.num_layers) for t in self._parts(layer, k_caches, v_caches)
                ]
                return torch.stack(parts).view(1, *self.block_shape).to("cpu")
            ids = torch.tensor(list(block_ids), dtype=torch.long, device=k_caches[0].device)
            out = torch.empty(
                (len(block_ids), *self.block_shape), dtype=self.dtype, device=k_caches[0].device
            )
            for layer in range(self.num_layers):
                for part, cache in enumerate(self._parts(layer, k_caches, v_caches)):
                    out[:, layer, part].copy_(cache.index_select(0, ids))
            return out.to("cpu")

    def _parts(
        self, layer: int, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        return (k_caches[layer],) if self.num_parts == 1 else (k_caches[layer], v_caches[layer])
