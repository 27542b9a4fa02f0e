"""DiLoCo and Streaming DiLoCo: many local steps, then one outer step on the averaged change.

DiLoCo (Douillard et al. 2023): each worker (a data-parallel rank) takes H inner optimizer steps
on its own data, then the workers average their parameter change, the *outer gradient*
Δ = θ_global − θ_local, and an outer SGD step with Nesterov momentum moves the shared θ_global:

    m ← μ·m + Δ̄          θ_global ← θ_global − η_out·(Δ̄ + μ·m)          θ_local ← θ_global

With η_out = 1 and μ = 0 this is local SGD's parameter averaging (θ_global ← mean θ_local).
Read `mpdl.parallel.naive.NaiveDiLoCo` first: one all-reduce per parameter, every H steps.

`DiLoCo` adds what Streaming DiLoCo (Douillard et al. 2025) adds:
- **Fragments.** The parameters, in model order, are cut into F fragments of about equal bytes;
  fragment f is synchronised at the steps s with s mod H = ⌊(f+1)·H/F⌋ mod H, so the bytes of a
  period are spread over it instead of arriving at once.
- **Overlap.** A fragment's all-reduce starts in the background (`allreduce_async`) and its
  outer step is applied at the next step, after one more inner step. The late update is merged
  by keeping that step's progress: θ_local ← θ_global + (θ_local − θ_local at the sync).
- **Compressed outer gradients** (`compress`): fp16 (rounded to 16 bits; the sum travels as
  float32 partials unless MPDL_ROUND_PER_HOP=1, mpdl's rule for 16-bit sums), int8 or int4
  (absmax-scaled blocks of 256 values, all-gathered and summed in rank order), each with error
  feedback: what the quantisation lost is added to the next outer gradient.

Bytes counted (`allreduce_bytes`, what this rank sends): an all-reduce of n bytes costs
2(p−1)/p·n (ring and Rabenseifner), an all-gather of this rank's n bytes (p−1)·n.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpdl.backend import get_array_module
from mpdl.collectives import allgather, allreduce, allreduce_async
from mpdl.collectives.ops import reduced_bytes
from mpdl.comm import as_communicator
from mpdl.parallel import flat

#: the outer gradient's encodings on the wire
OUTER_COMPRESSORS = ("none", "fp16", "int8", "int4")
#: values per absmax scale in int8 and int4
QUANT_BLOCK = 256


def nesterov_step(global_: Any, delta: Any, momentum: Any, lr: float, mu: float) -> None:
    """The outer step in place (PyTorch's SGD with nesterov=True, the outer gradient `delta`)."""
    momentum *= mu
    momentum += delta
    global_ -= lr * (delta + mu * momentum)


def allreduce_bytes(nbytes: int, p: int) -> int:
    """The bytes one rank sends in a bandwidth-optimal all-reduce of nbytes over p ranks."""
    return 2 * (p - 1) * nbytes // p if p > 1 else 0


def fragments(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of consecutive items (bytes `sizes`) cut into n groups of about equal bytes, none
    empty (n at most len(sizes))."""
    if not 1 <= n <= len(sizes):
        raise ValueError(f"fragments: expected 1 to {len(sizes)} fragments (one per parameter at "
                         f"most), got {n}")
    total, groups, done = sum(sizes), [[] for _ in range(n)], 0
    for i, size in enumerate(sizes):
        # the fragment whose share of the bytes this item's middle falls in, leaving one item
        # for each fragment still empty
        f = min(int((done + size / 2) * n / max(total, 1)), n - 1)
        f = max(f, n - (len(sizes) - i))
        f = min(f, next((k for k, g in enumerate(groups) if not g), n - 1))
        groups[f].append(i)
        done += size
    return groups


def quantize(x: Any, bits: int) -> tuple[Any, Any]:
    """x (float32, 1-D) as signed integers of `bits` bits (int4: two per byte) and one float32
    absmax scale per block of QUANT_BLOCK values."""
    xp = get_array_module(x)
    levels = 2 ** (bits - 1) - 1
    blocks = -(-x.size // QUANT_BLOCK)
    padded = xp.zeros(blocks * QUANT_BLOCK, xp.float32)
    padded[:x.size] = x
    padded = padded.reshape(blocks, QUANT_BLOCK)
    scale = (xp.abs(padded).max(axis=1) / levels).astype(xp.float32)
    safe = xp.where(scale > 0, scale, xp.float32(1))
    q = xp.clip(xp.rint(padded / safe[:, None]), -levels, levels).astype(xp.int8).reshape(-1)
    if bits == 4:  # two's-complement nibbles, the even element low
        q = ((q[0::2] & 0x0F) | ((q[1::2] & 0x0F) << 4)).astype(xp.int8)
    return q, scale


def dequantize(q: Any, scale: Any, bits: int, n: int) -> Any:
    """The float32 values `quantize` encoded (the first n)."""
    xp = get_array_module(q)
    if bits == 4:
        u = q.view(xp.uint8)
        nibbles = xp.stack([u & 0x0F, u >> 4], axis=1).reshape(-1).astype(xp.int8)
        q = xp.where(nibbles > 7, nibbles - 16, nibbles).astype(xp.int8)
    values = q.reshape(-1, QUANT_BLOCK).astype(xp.float32) * scale[:, None]
    return values.reshape(-1)[:n]


class _Fragment:
    """One fragment's flat views: the shared θ_global, the outer momentum, the error feedback,
    and the all-reduce in flight."""

    def __init__(self, tensors: list[Any], offset: int) -> None:
        self.tensors, self.offset = tensors, offset
        self.groups = flat.by_kind(tensors)
        self.global_ = [flat.pack([t.data for t in g]) for g in self.groups]
        self.momentum = [get_array_module(g).zeros_like(g) for g in self.global_]
        self.error = [get_array_module(g).zeros_like(g) for g in self.global_]
        self.pending: list[Any] = []
        self.local_at_sync: list[Any] = []
        #: the inner step count at the last synchronisation
        self.synced_at = 0

    def local(self) -> list[Any]:
        return [flat.pack([t.data for t in g]) for g in self.groups]

    def write(self, values: list[Any]) -> None:
        for group, packed in zip(self.groups, values, strict=True):
            for t, piece in zip(group, flat.unpack(packed, group), strict=True):
                t.data[...] = piece


class DiLoCo:
    """DiLoCo over `comm` for `module`'s parameters: call `step()` after every inner optimizer
    step. `fragments` > 1 with `overlap` is Streaming DiLoCo. Construction broadcasts nothing:
    the replicas must start equal (the strategies broadcast rank 0's model first)."""

    def __init__(self, module: Any, comm: Any = None, sync_every: int = 50, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, n_fragments: int = 1, compress: str = "none",
                 overlap: bool | None = None, algorithm: str = "auto") -> None:
        if compress not in OUTER_COMPRESSORS:
            raise ValueError(f"compress: expected one of {', '.join(OUTER_COMPRESSORS)}, "
                             f"got {compress!r}")
        if not isinstance(sync_every, int | np.integer) or sync_every < 1:
            raise ValueError(f"sync_every: expected a positive number of steps, got {sync_every!r}")
        self.comm = as_communicator(comm)
        self.sync_every, self.algorithm, self.compress = int(sync_every), algorithm, compress
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        #: background all-reduces, applied one step later (default: with several fragments)
        self.overlap = n_fragments > 1 if overlap is None else overlap
        params = [p for p in module.parameters() if p.requires_grad]
        cut = fragments(sizes=[int(p.data.nbytes) for p in params], n=n_fragments)
        h = self.sync_every
        self.fragments = [_Fragment([params[i] for i in idx], ((f + 1) * h // n_fragments) % h)
                          for f, idx in enumerate(cut)]
        self.steps = 0
        #: outer steps taken (one per fragment synchronised) and the bytes this rank sent
        self.syncs = 0
        self.allreduce_bytes = 0

    def step(self) -> None:
        """Count an inner step: apply the outer steps that arrived, start those that are due."""
        self.steps += 1
        for frag in self.fragments:
            if frag.pending:
                self._finish(frag)
            if self.steps % self.sync_every == frag.offset:
                self._start(frag)
                if not self.overlap:
                    self._finish(frag)

    def finish(self) -> None:
        """End of training: every fragment not synchronised at the last step takes its outer
        step now, so that all replicas hold θ_global."""
        for frag in self.fragments:
            if frag.pending:
                self._finish(frag)
            elif frag.synced_at != self.steps:
                self._start(frag)
                self._finish(frag)

    def _start(self, frag: _Fragment) -> None:
        frag.synced_at = self.steps
        local = frag.local()
        frag.local_at_sync = local
        p = self.comm.size
        frag.pending = []
        for g, l, e in zip(frag.global_, local, frag.error, strict=True):
            delta = g - l
            if self.compress == "none":
                self.allreduce_bytes += allreduce_bytes(delta.nbytes, p)
                frag.pending.append(self._reduce(delta))
                continue
            delta += e  # error feedback: what the last encoding lost
            if self.compress == "fp16":
                wire = delta.astype(np.float16)
                e[...] = delta - wire.astype(delta.dtype)
                self.allreduce_bytes += allreduce_bytes(reduced_bytes(wire, "sum"), p)
                frag.pending.append(self._reduce(wire))
                continue
            bits = 8 if self.compress == "int8" else 4
            q, scale = quantize(delta, bits)
            sent = dequantize(q, scale, bits, delta.size)
            e[...] = delta - sent
            self.allreduce_bytes += (p - 1) * (q.nbytes + scale.nbytes)
            frag.pending.append((bits, delta.size, allgather(q, comm=self.comm),
                                 allgather(scale, comm=self.comm)))

    def _reduce(self, x: Any) -> Any:
        if self.comm.size == 1:
            return x
        if self.overlap:
            return allreduce_async(x, op="sum", algorithm=self.algorithm, comm=self.comm)
        return allreduce(x, op="sum", algorithm=self.algorithm, comm=self.comm)

    def _finish(self, frag: _Fragment) -> None:
        p = self.comm.size
        new = []
        for g, m, pending in zip(frag.global_, frag.momentum, frag.pending, strict=True):
            if isinstance(pending, tuple):
                bits, n, q_all, scales = pending
                per_q, per_s = q_all.size // p, scales.size // p
                total = get_array_module(g).zeros(n, np.float32)
                for r in range(p):  # rank order: the same sum on every rank
                    total += dequantize(q_all[r * per_q:(r + 1) * per_q],
                                        scales[r * per_s:(r + 1) * per_s], bits, n)
            else:
                total = pending.wait() if hasattr(pending, "wait") else pending
            mean = total.astype(g.dtype) / g.dtype.type(p)
            nesterov_step(g, mean, m, self.outer_lr, self.outer_momentum)
            new.append(g)
        if self.overlap:  # keep the inner steps taken while the all-reduce ran
            now = frag.local()
            new = [g + (n - s) for g, n, s in zip(frag.global_, now, frag.local_at_sync,
                                                   strict=True)]
        frag.write(new)
        frag.pending, frag.local_at_sync = [], []
        self.syncs += 1
