"""Gradient compression with error feedback, in the spirit of GRACE (Xu et al. 2021).

A `Compressor` turns a flat gradient into a payload (a list of arrays) and back:
`compress(x, info) -> (payload, ctx)` and `decompress(payload, ctx) -> x̂`. `ctx` holds only what
every rank knows alike (the length, k, the number of chunks), so that one rank can decode another
rank's payload. An error-feedback memory adds the residual of earlier steps before compressing and
keeps what the compressor dropped: residual ← (g + residual) − decompress(compress(g + residual)).

`GradientCompression` ties a compressor and a memory to a communicator and sums one flat buffer
over the ranks in the way the payload allows:

* linear payloads (fp16, PowerSGD's P and Q) are all-reduced: the sum of payloads is the payload of
  the sum;
* sparse or quantized payloads (top-k, QSGD, sign) are packed into one byte buffer, all-gathered,
  and every rank decodes all p payloads and adds them in rank order, so the sum is bit-identical
  on every rank.

Stochastic rounding (QSGD) draws from a generator seeded by (seed, key, step, rank), so a run is
reproducible and independent of timing. Payloads are built on the host; device arrays are copied
there and the result copied back.

Compressors: none, fp16, topk (DGC: error feedback, momentum correction, sparsity warmup), qsgd
(s levels, int8 plus one norm per chunk), signsgd (1 bit per value, bit-packed, scaled, error
feedback), powersgd (rank r, error feedback, warm-started Q).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpdl import backend
from mpdl.collectives import allgather, allreduce
from mpdl.comm import Communicator, as_communicator

COMPRESSORS = ("none", "fp16", "topk", "qsgd", "signsgd", "powersgd")


@dataclass(frozen=True)
class StepInfo:
    """Which buffer (key), which call on it (step), which rank is compressing, and the sizes of
    the tensors packed in the buffer (None: one tensor)."""

    key: Any = 0
    step: int = 0
    rank: int = 0
    sizes: tuple[int, ...] | None = None


class Compressor:
    """compress / decompress of one flat float array. `aggregation` says how payloads are summed:
    "allreduce" (the payload is linear in x) or "allgather" (decode each rank's, then add)."""

    name = "base"
    aggregation = "allreduce"
    #: whether GradientCompression adds an error-feedback memory unless told otherwise
    error_feedback = False

    def compress(self, x: np.ndarray, info: StepInfo) -> tuple[list[np.ndarray], Any]:
        raise NotImplementedError

    def decompress(self, payload: Sequence[np.ndarray], ctx: Any) -> np.ndarray:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class NoCompression(Compressor):
    """The dense gradient, all-reduced as is."""

    name = "none"

    def compress(self, x, info):
        return [x], None

    def decompress(self, payload, ctx):
        return payload[0]


class FP16Compressor(Compressor):
    """A cast to float16. Its sum travels as float32 partials rounded once unless
    MPDL_ROUND_PER_HOP=1 keeps it float16, half the bytes of float32, which is what `wire_bytes`
    counts (`mpdl.collectives.ops.reduces_wide`)."""

    name = "fp16"

    def compress(self, x, info):
        return [x.astype(np.float16)], x.dtype

    def decompress(self, payload, ctx):
        return payload[0].astype(ctx)


class TopKCompressor(Compressor):
    """Deep Gradient Compression (Lin et al. 2018): send the k = ratio·n largest-magnitude values
    and their int32 indices. Error feedback keeps the rest (`DGCMemory` adds momentum correction).

    Sparsity warmup: over the first `warmup_steps` calls on a buffer the kept fraction decays
    geometrically from `warmup_start` to `ratio` (DGC's 75 %, 93.75 %, ... sparsity ramp).
    """

    name = "topk"
    aggregation = "allgather"
    error_feedback = True

    def __init__(self, ratio: float = 0.01, warmup_steps: int = 0, warmup_start: float = 0.25
                 ) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio: expected a fraction in (0, 1], got {ratio!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected >= 0, got {warmup_steps!r}")
        self.ratio, self.warmup_steps = float(ratio), int(warmup_steps)
        self.warmup_start = max(float(warmup_start), self.ratio)

    def density(self, step: int) -> float:
        """The fraction of values sent at this step (sparsity warmup, then `ratio`)."""
        if step >= self.warmup_steps:
            return self.ratio
        f = step / self.warmup_steps
        return math.exp((1 - f) * math.log(self.warmup_start) + f * math.log(self.ratio))

    def k(self, n: int, step: int) -> int:
        return min(n, max(1, int(math.ceil(self.density(step) * n)))) if n else 0

    def compress(self, x, info):
        n = x.size
        k = self.k(n, info.step)
        if k == n:
            idx = np.arange(n, dtype=np.int32)
        else:
            idx = np.sort(np.argpartition(np.abs(x), n - k)[n - k:]).astype(np.int32)
        return [idx, x[idx]], (n, x.dtype)

    def decompress(self, payload, ctx):
        n, dtype = ctx
        out = np.zeros(n, dtype=dtype)
        out[payload[0]] = payload[1]
        return out

    def describe(self) -> str:
        warm = f", warmup {self.warmup_steps} steps" if self.warmup_steps else ""
        return f"topk (ratio {self.ratio:g}{warm})"


class QSGDCompressor(Compressor):
    """QSGD (Alistarh et al. 2017): per chunk of `chunk` values, x_i ≈ ‖x‖·sign(x_i)·l_i/s where
    l_i ∈ {0..s} is |x_i|/‖x‖·s rounded up or down at random so that the estimate is unbiased.
    Payload: int8 signed levels (s ≤ 127) plus one float32 norm per chunk."""

    name = "qsgd"
    aggregation = "allgather"

    def __init__(self, levels: int = 127, chunk: int = 512, seed: int = 0) -> None:
        if not isinstance(levels, int | np.integer) or not 1 <= levels <= 127:
            raise ValueError(f"levels: expected an integer in [1, 127] (int8 payload), got {levels!r}")
        if chunk < 1:
            raise ValueError(f"chunk: expected a positive number of values, got {chunk!r}")
        self.levels, self.chunk, self.seed = int(levels), int(chunk), int(seed)

    def rng(self, info: StepInfo) -> np.random.Generator:
        return np.random.default_rng([self.seed, _stable(info.key), info.step, info.rank])

    def compress(self, x, info):
        n, s = x.size, self.levels
        chunks = max(1, -(-n // self.chunk))
        padded = np.zeros(chunks * self.chunk, dtype=np.float64)
        padded[:n] = x
        blocks = padded.reshape(chunks, self.chunk)
        norms = np.sqrt((blocks * blocks).sum(axis=1)).astype(np.float32)
        safe = np.where(norms > 0, norms, 1).astype(np.float64)[:, None]
        scaled = np.abs(blocks) / safe * s
        low = np.floor(scaled)
        up = self.rng(info).random(scaled.shape) < (scaled - low)
        level = np.minimum(low + up, s) * np.sign(blocks)
        return [level.reshape(-1)[:n].astype(np.int8), norms], (n, x.dtype)

    def decompress(self, payload, ctx):
        n, dtype = ctx
        levels, norms = payload
        scale = np.repeat(norms.astype(np.float64) / self.levels, self.chunk)[:n]
        return (levels.astype(np.float64) * scale).astype(dtype)

    def describe(self) -> str:
        return f"qsgd ({self.levels} levels, chunks of {self.chunk})"


class SignSGDCompressor(Compressor):
    """Scaled sign with error feedback (EF-SignSGD, Karimireddy et al. 2019): per tensor,
    x ≈ mean|x|·sign(x); one bit per value (numpy.packbits) plus one float32 scale per tensor."""

    name = "signsgd"
    aggregation = "allgather"
    error_feedback = True

    def compress(self, x, info):
        sizes = info.sizes or (x.size,)
        bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        scale = np.array([np.abs(x[a:b]).mean() if b > a else 0.0
                          for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dtype=np.float32)
        return [np.packbits(x >= 0), scale], (x.size, x.dtype, bounds)

    def decompress(self, payload, ctx):
        n, dtype, bounds = ctx
        bits, scale = payload
        signs = np.unpackbits(bits, count=n).astype(dtype) * 2 - 1
        return signs * np.repeat(scale.astype(dtype), np.diff(bounds))


class PowerSGDCompressor(Compressor):
    """PowerSGD (Vogels et al. 2019): each matrix M (n×m) is sent as P = M·Q (n×r) and, after P is
    summed and orthonormalised, Q = Mᵀ·P̂ (m×r); M ≈ P̂·Qᵀ. Both sums are all-reduces (the payload is
    linear). Q starts from the previous step's (warm start); error feedback keeps M − P̂·Q_localᵀ.

    A buffer is split by `shapes` (one per parameter): ≥2-D parameters become matrices (first
    dimension × the rest) when rank r makes them smaller; 1-D ones and matrices that would not
    shrink travel dense in the same all-reduce as P. Without shapes, the whole buffer is one
    near-square matrix (zero-padded).
    """

    name = "powersgd"
    aggregation = "powersgd"
    error_feedback = True

    def __init__(self, rank: int = 2, seed: int = 0) -> None:
        if not isinstance(rank, int | np.integer) or rank < 1:
            raise ValueError(f"rank: expected a positive integer, got {rank!r}")
        self.rank, self.seed = int(rank), int(seed)
        self._q: dict[Any, list[np.ndarray]] = {}

    def layout(self, n: int, shapes: Sequence[tuple[int, ...]] | None
               ) -> list[tuple[int, int, int, int] | tuple[int, int]]:
        """(offset, size, rows, cols) per compressed matrix, (offset, size) per dense piece."""
        if shapes is None:
            rows = max(1, int(math.ceil(math.sqrt(n))))
            cols = max(1, -(-n // rows))
            if self.rank * (rows + cols) < n:
                return [(0, n, rows, cols)]
            return [(0, n)]
        out: list = []
        offset = 0
        for shape in shapes:
            size = int(np.prod(shape)) if len(shape) else 1
            if len(shape) >= 2:
                rows, cols = int(shape[0]), size // int(shape[0])
                if self.rank * (rows + cols) < size:
                    out.append((offset, size, rows, cols))
                    offset += size
                    continue
            out.append((offset, size))
            offset += size
        if offset != n:
            raise ValueError(f"shapes: they cover {offset} values, the buffer has {n}")
        return out

    def reduce(self, m: np.ndarray, comm: Communicator, info: StepInfo,
               shapes: Sequence[tuple[int, ...]] | None, algorithm: str
               ) -> tuple[np.ndarray, np.ndarray, int]:
        """(sum over ranks of the approximations, this rank's approximation, bytes sent)."""
        r = self.rank
        pieces = self.layout(m.size, shapes)
        mats = [p for p in pieces if len(p) == 4]
        dense = [p for p in pieces if len(p) == 2]
        qs = self._q.get(info.key)
        if qs is None:
            rng = np.random.default_rng([self.seed, _stable(info.key)])
            qs = self._q[info.key] = [rng.standard_normal((c, r)).astype(m.dtype)
                                      for _, _, _, c in mats]
        matrices = []
        for off, size, rows, cols in mats:
            block = np.zeros(rows * cols, dtype=m.dtype)
            block[:size] = m[off:off + size]
            matrices.append(block.reshape(rows, cols))
        ps = [a @ q for a, q in zip(matrices, qs, strict=True)]
        first = np.concatenate([p.reshape(-1) for p in ps] +
                               [m[off:off + size] for off, size in dense] + [np.zeros(0, m.dtype)])
        summed = allreduce(first, op="sum", algorithm=algorithm, comm=comm) if comm.size > 1 \
            else first
        total, local = np.empty_like(m), np.empty_like(m)
        pos = 0
        hats = []
        for _, _, rows, _ in mats:
            hats.append(orthonormalise(summed[pos:pos + rows * r].reshape(rows, r)))
            pos += rows * r
        for off, size in dense:
            total[off:off + size] = summed[pos:pos + size]
            local[off:off + size] = m[off:off + size]
            pos += size
        q_local = [a.T @ h for a, h in zip(matrices, hats, strict=True)]
        second = np.concatenate([q.reshape(-1) for q in q_local] + [np.zeros(0, m.dtype)])
        q_sum = allreduce(second, op="sum", algorithm=algorithm, comm=comm) if comm.size > 1 \
            else second
        pos = 0
        for i, ((off, size, _, cols), h) in enumerate(zip(mats, hats, strict=True)):
            q = q_sum[pos:pos + cols * r].reshape(cols, r)
            pos += cols * r
            total[off:off + size] = (h @ q.T).reshape(-1)[:size]
            local[off:off + size] = (h @ q_local[i].T).reshape(-1)[:size]
            qs[i] = q.copy()
        return total, local, int(first.nbytes + second.nbytes)

    def describe(self) -> str:
        return f"powersgd (rank {self.rank})"


def _stable(key: Any) -> int:
    """A non-negative integer for key, the same in every process (unlike hash())."""
    if isinstance(key, int | np.integer) and key >= 0:
        return int(key)
    return zlib.crc32(repr(key).encode())


def orthonormalise(p: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Columns of p made orthonormal by Gram–Schmidt, in column order (deterministic)."""
    out = p.astype(np.float64)
    for j in range(out.shape[1]):
        col = out[:, j]
        for i in range(j):
            col -= (out[:, i] @ col) * out[:, i]
        col /= max(float(np.sqrt(col @ col)), eps)
    return out.astype(p.dtype)


# -- error-feedback memories ------------------------------------------------------------------------
class NoMemory:
    """No error feedback: compress the gradient as it is."""

    def compensate(self, x: np.ndarray, key: Any) -> np.ndarray:
        return x

    def update(self, key: Any, compensated: np.ndarray, sent: np.ndarray) -> None:
        return None

    def residual(self, key: Any) -> np.ndarray | None:
        return None


class ResidualMemory(NoMemory):
    """Error feedback: add what earlier steps left out, keep what this step leaves out."""

    def __init__(self) -> None:
        self._residual: dict[Any, np.ndarray] = {}

    def compensate(self, x, key):
        e = self._residual.get(key)
        return x.copy() if e is None else x + e

    def update(self, key, compensated, sent):
        self._residual[key] = compensated - sent

    def residual(self, key):
        return self._residual.get(key)


class DGCMemory(ResidualMemory):
    """DGC's momentum correction: accumulate the velocity u ← m·u + g instead of g, so that the
    values sent late still carry their momentum; momentum factor masking clears u where a value
    was sent. The optimizer should then run without momentum."""

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum: expected a value in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self._velocity: dict[Any, np.ndarray] = {}

    def compensate(self, x, key):
        u = self._velocity.get(key)
        u = x.copy() if u is None else u * x.dtype.type(self.momentum) + x
        self._velocity[key] = u
        return super().compensate(u, key)

    def update(self, key, compensated, sent):
        super().update(key, compensated, sent)
        self._velocity[key][sent != 0] = 0


# -- aggregation --------------------------------------------------------------------------------
def _pack(payload: Sequence[np.ndarray]) -> np.ndarray:
    """The payload's bytes, zero-padded to whole int32 words (what the collectives carry)."""
    raw = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in payload]
                         + [np.zeros(0, np.uint8)])
    words = np.zeros(-(-raw.size // 4), dtype=np.int32)
    words.view(np.uint8)[:raw.size] = raw
    return words


def _unpack(words: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    raw = words.view(np.uint8)
    out, pos = [], 0
    for a in like:
        out.append(raw[pos:pos + a.nbytes].view(a.dtype).reshape(a.shape))
        pos += a.nbytes
    return out


class GradientCompression:
    """Sum a flat gradient buffer over the ranks through `compressor`, with error feedback.

    `aggregate(x, comm, key, shapes)` returns the sum over ranks of each rank's decompressed
    payload (x's shape, dtype and array kind), bit-identical on every rank. `key` names the buffer
    (a DDP bucket index): memories, warm starts and step counters are kept per key, and every rank
    must aggregate the same keys in the same order. `last_wire_bytes` / `last_dense_bytes` are the
    bytes this rank contributed in the last call and what the dense buffer would have been;
    `wire_bytes` / `dense_bytes` accumulate them.
    """

    def __init__(self, compressor: Compressor, error_feedback: bool | None = None,
                 momentum: float = 0.0, algorithm: str = "auto") -> None:
        self.compressor = compressor
        ef = compressor.error_feedback if error_feedback is None else bool(error_feedback)
        if momentum and not isinstance(compressor, TopKCompressor):
            raise ValueError("momentum: momentum correction is DGC's, only for the topk compressor")
        if momentum:
            self.memory: NoMemory = DGCMemory(momentum)
        else:
            self.memory = ResidualMemory() if ef else NoMemory()
        self.algorithm = algorithm
        self.steps: dict[Any, int] = {}
        self.last_wire_bytes = self.last_dense_bytes = 0
        self.wire_bytes = self.dense_bytes = 0

    @property
    def name(self) -> str:
        return self.compressor.name

    def describe(self) -> str:
        memory = {NoMemory: "", ResidualMemory: " + error feedback",
                  DGCMemory: " + error feedback + momentum correction"}[type(self.memory)]
        return self.compressor.describe() + memory

    @property
    def ratio(self) -> float:
        """Bytes sent over dense bytes, over every call so far (1.0 before the first)."""
        return self.wire_bytes / self.dense_bytes if self.dense_bytes else 1.0

    def aggregate(self, x: Any, comm: Any = None, key: Any = 0,
                  shapes: Sequence[tuple[int, ...]] | None = None) -> Any:
        xp = backend.get_array_module(x)
        flat = backend.to_host(x).reshape(-1)
        if flat.dtype.kind != "f":
            raise TypeError(f"x: gradient compression needs a floating-point array, got {flat.dtype}")
        c = as_communicator(comm)
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        sizes = None if shapes is None else tuple(int(np.prod(s)) for s in shapes)
        if sizes is not None and sum(sizes) != flat.size:
            raise ValueError(f"shapes: they cover {sum(sizes)} values, the buffer has {flat.size}")
        info = StepInfo(key, step, c.rank, sizes)
        comp = self.compressor
        m = self.memory.compensate(flat, key)
        if isinstance(comp, PowerSGDCompressor):
            total, local, nbytes = comp.reduce(m, c, info, shapes, self.algorithm)
        else:
            payload, ctx = comp.compress(m, info)
            local = comp.decompress(payload, ctx)
            if comp.aggregation == "allreduce":
                nbytes = sum(a.nbytes for a in payload)
                summed = [allreduce(a, op="sum", algorithm=self.algorithm, comm=c)
                          if c.size > 1 else a for a in payload]
                total = comp.decompress(summed, ctx)
            else:
                words = _pack(payload)
                nbytes = sum(a.nbytes for a in payload)
                everyone = allgather(words, algorithm=self.algorithm, comm=c) if c.size > 1 \
                    else words
                total = np.zeros_like(flat)
                for r in range(c.size):
                    theirs = everyone[r * words.size:(r + 1) * words.size]
                    total += comp.decompress(_unpack(theirs, payload), ctx)
        self.memory.update(key, m, local)
        self.last_wire_bytes, self.last_dense_bytes = int(nbytes), int(flat.nbytes)
        self.wire_bytes += self.last_wire_bytes
        self.dense_bytes += self.last_dense_bytes
        result = np.asarray(total, dtype=flat.dtype).reshape(np.shape(x))
        return result if xp is np else backend.to_module(result, xp)


def make_compression(name: str, ratio: float = 0.01, levels: int = 127, rank: int = 2,
                     momentum: float = 0.0, warmup_steps: int = 0, seed: int = 0,
                     error_feedback: bool | None = None, algorithm: str = "auto"
                     ) -> GradientCompression | None:
    """The compression named `name` (one of COMPRESSORS); None for "none".

    ratio: top-k's kept fraction; levels: QSGD's s; rank: PowerSGD's r; momentum: top-k's DGC
    momentum correction (then run the optimizer without momentum); warmup_steps: top-k's sparsity
    warmup; error_feedback: override the compressor's default (on for topk, signsgd, powersgd).
    """
    if name not in COMPRESSORS:
        raise ValueError(f"compression: expected one of {', '.join(COMPRESSORS)}, got {name!r}")
    if name == "none":
        return None
    if name == "fp16":
        comp: Compressor = FP16Compressor()
    elif name == "topk":
        comp = TopKCompressor(ratio, warmup_steps)
    elif name == "qsgd":
        comp = QSGDCompressor(levels, seed=seed)
    elif name == "signsgd":
        comp = SignSGDCompressor()
    else:
        comp = PowerSGDCompressor(rank, seed=seed)
    return GradientCompression(comp, error_feedback=error_feedback,
                               momentum=momentum if name == "topk" else 0.0, algorithm=algorithm)


__all__ = ["COMPRESSORS", "Compressor", "NoCompression", "FP16Compressor", "TopKCompressor",
           "QSGDCompressor", "SignSGDCompressor", "PowerSGDCompressor", "GradientCompression",
           "NoMemory", "ResidualMemory", "DGCMemory", "StepInfo", "make_compression",
           "orthonormalise"]
