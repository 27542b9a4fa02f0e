"""The α-β-γ cost model of every collective algorithm, and the `auto` choice it drives.

α is the time of one message (with Python's cost of posting and completing it, which dominates
small messages here), β the time per byte on a link, γ the time per byte reduced (per dtype).
Links inside a node and between nodes have their own α and β. `mpdl calibrate` measures them all
while every rank communicates at once (as in a collective) and saves them as JSON; `load_params`
reads that file (MPDL_COST_MODEL, or ~/.cache/mpdl/costmodel.json) and falls back to defaults.

`predict(collective, algorithm, nbytes, p, nodes, params)` of an all-reduce interpolates the
algorithm's measured times (`Params.allreduce_times`) when the parameters were measured for this
world shape (a first-use calibration or `mpdl calibrate` times every candidate at a few sizes);
otherwise, and for the other collectives, it follows the algorithm's code: the number
of sequential message steps, the bytes each step carries, pipeline segments (MPDL_SEGMENT_BYTES),
and which steps cross a node boundary (nodes are taken as p/nodes consecutive ranks). An algorithm
without a formula here is estimated from its message log on the in-process world.

`fastest` returns the algorithm with the smallest prediction. It is a pure function of its
arguments and the parameter file, which every rank reads itself, so all ranks pick the same one;
ties go to the algorithm registered first. `mpdl.tuning.auto` remembers its choices.

The formulas are named after what they time (`ring_reduce_scatter_time` times the algorithm
`ring_reduce_scatter`); `FORMULAS` maps each registered (collective, algorithm) of
`registry.REGISTRY` to one, and is checked against that table when this module loads.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from mpdl import emulation as _emulation
from mpdl import settings
from mpdl.collectives import registry
from mpdl.collectives.hierarchical import INTER_RING_BYTES
from mpdl.collectives.hook import MPICH_ALLTOALL_MEDIUM_BYTES, MPICH_ALLTOALL_SHORT_BYTES
from mpdl.collectives.ops import block_bounds, segment_elements
from mpdl.collectives.scattered import THROTTLE
from mpdl.collectives.shm import WINDOW_BYTES
from mpdl.collectives.torus import grid_shape
from mpdl.fileio import atomic_open
from mpdl.threadworld import run_world

ENV = "MPDL_COST_MODEL"
FORMAT_VERSION = 1
#: MPICH's switch from recursive doubling to Rabenseifner (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE)
MPICH_SHORT_BYTES = 2048


class ModelUnavailable(RuntimeError):
    """The parameter file exists but cannot be used (or MPDL_COST_MODEL=off)."""


#: the smallest last size of a partial table of measured all-reduce times whose time per byte
#: predicts the sizes beyond it (`Params.allreduce_times_partial`)
PARTIAL_RATE_BYTES = 1 << 20


@dataclass(frozen=True)
class Params:
    """Machine parameters in seconds (per message, per byte). `*_inter` default to the intra values."""

    # The defaults (used until a calibration, or where nothing can be measured) are what
    # `mpdl calibrate` measures for 2 ranks on one node of a current x86 server, rounded.
    alpha: float = 10e-6
    beta: float = 1 / 4.0e9
    gamma: float = 1 / 4.0e9
    alpha_inter: float | None = None
    beta_inter: float | None = None
    #: seconds per byte of a local memory copy of data not in cache (the API's input copy)
    copy: float = 1 / 4.0e9
    #: the same for data a core's caches hold (the shm algorithm's window chunks); 0: as `copy`.
    #: Its ratio to `copy` also scales the shm algorithm's reductions
    copy_cached: float = 1 / 40.0e9
    #: one node barrier (the shm algorithm takes two per call)
    barrier: float = 25e-6
    #: the fixed cost of one call of the public API, before any message
    call: float = 5e-6
    #: what a collective handed to the communication thread (`*_async`, as DDP's buckets and
    #: ZeRO's units are) and waited for costs beyond the call itself (0: not measured)
    handoff: float = 0.0
    #: what a rank waiting for a message takes from a core it shares with ranks that compute
    #: (more ranks than cores): the CPU seconds of one wait however short (its polls before it
    #: sleeps), and the share of a core for each second it lasts (0: not measured)
    wait_cpu: float = 0.0
    wait_share: float = 0.0
    #: the MPI library's own per-message latency (the `mpi` baseline has no Python in its loop)
    alpha_native: float = 3e-6
    #: γ per dtype name; `gamma` serves dtypes not listed
    gammas: tuple[tuple[str, float], ...] = field(default=())
    #: measured (bytes, seconds) of one intra-node exchange, when calibrated: messages inside a
    #: node are timed by interpolating these rather than by α + n·β (caches make the curve bend)
    exchange: tuple[tuple[float, float], ...] = field(default=())
    #: the same for one step round a ring of all a node's ranks (each sends to the next), timed
    #: within 2(p-1) steps in a row as a ring all-reduce takes them: with more ranks than cores a
    #: ring step needs every rank scheduled, a pairwise step only two
    ring_exchange: tuple[tuple[float, float], ...] = field(default=())
    #: the same for one step of the ring reduce-scatter (the block received is added into the
    #: next one), timed in a chain as `ring_exchange`: the reduction of a block just received is
    #: charged at the rate it runs at (in cache), not at `gamma` (data not in cache)
    ring_reduce_exchange: tuple[tuple[float, float], ...] = field(default=())
    #: measured (bytes, seconds) of the API's input copy on buffers copied call after call (what
    #: fits in the caches stays there); empty: nbytes · `copy`
    copy_curve: tuple[tuple[float, float], ...] = field(default=())
    #: measured (bytes, seconds) of each all-reduce algorithm with the API's input copy (not the
    #: call's fixed cost) at a few sizes, on `ranks` ranks over `nodes` nodes, when a first-use
    #: calibration timed them: `predict` interpolates these for that world shape, not the formula
    allreduce_times: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = field(default=())
    #: the first-use calibration's time ran out before the table's last size: beyond its last
    #: size the formula predicts where that size is below PARTIAL_RATE_BYTES (a small size's time
    #: per byte says nothing of large ones; from 1 MiB the rate holds, as beyond a whole table)
    allreduce_times_partial: bool = False
    #: the node count the parameters were measured over (0: not recorded)
    nodes: int = 0
    #: float32 FLOP/s of one core on a 512×512 GEMM, the best rank's (0: not measured); the peak
    #: against which `mpdl train` reports model-FLOPs utilisation
    gemm_flops: float = 0.0
    #: the world size the parameters were measured at (0: defaults)
    ranks: int = 0
    source: str = "defaults"
    #: why the calibration is provisional (taken on a busy machine: used, never the final word);
    #: "" for a calibration taken on a quiet machine
    provisional: str = ""

    def link(self, inter: bool) -> tuple[float, float]:
        """(α, β) of an intra-node or an inter-node link."""
        if not inter:
            return self.alpha, self.beta
        return (self.alpha if self.alpha_inter is None else self.alpha_inter,
                self.beta if self.beta_inter is None else self.beta_inter)

    def exchange_time(self, nbytes: float, ring: bool = False) -> float:
        """Seconds of one intra-node message of nbytes from the measured curve (the ring curve for
        a ring step, when measured): linear between measured sizes, the smallest size's time
        below them, the last slope beyond them."""
        return curve_time(self.ring_exchange if ring and self.ring_exchange else self.exchange,
                          nbytes)

    def copy_time(self, nbytes: float) -> float:
        """Seconds of the API's input copy of nbytes: the measured curve, else nbytes · copy."""
        if not self.copy_curve or nbytes <= 0:
            return nbytes * self.copy
        return curve_time(self.copy_curve, nbytes)

    def gamma_for(self, dtype: str) -> float:
        return dict(self.gammas).get(np.dtype(dtype).name, self.gamma)

    def emulated(self, emu: _emulation.Emulation | None) -> Params:
        """These parameters with the emulated links' latency and transfer time added."""
        if emu is None:
            return self
        a_in, b_in = self.link(False)
        a_out, b_out = self.link(True)
        table, ring_table, reduce_table = self.exchange, self.ring_exchange, \
            self.ring_reduce_exchange
        if emu.intra is not None:
            a_in, b_in = a_in + emu.intra.latency, b_in + 1 / emu.intra.bandwidth
            table = ring_table = reduce_table = ()  # the emulated link is an α-β link
        if emu.inter is not None:
            a_out, b_out = a_out + emu.inter.latency, b_out + 1 / emu.inter.bandwidth
        return replace(self, alpha=a_in, beta=b_in, alpha_inter=a_out, beta_inter=b_out,
                       allreduce_times=(),  # measured on the real links, not the emulated ones
                       exchange=table, ring_exchange=ring_table,
                       ring_reduce_exchange=reduce_table,
                       source=f"{self.source} + emulated {emu.describe()}")

    def measured_time(self, algorithm: str, nbytes: float, p: int, nodes: int) -> float | None:
        """The all-reduce algorithm's body time from `allreduce_times` (linear between measured
        sizes, the smallest size's time below them, the last size's time per byte beyond them),
        when they were measured for this world shape and size; None otherwise (beyond the last
        size of a partial table too). Beyond the last size each
        algorithm keeps the rate measured there, so their ranking there holds (the slope of the
        last two sizes, a difference of two noisy times, ranked them wrongly:
        docs/results/auto.md#beyond-the-last-measured-size)."""
        if not self.allreduce_times or p != self.ranks or nodes != self.nodes:
            return None
        table = dict(self.allreduce_times).get(algorithm)
        if not table:
            return None
        sizes = [b for b, _ in table]
        times = [t for _, t in table]
        if nbytes > sizes[-1] and self.allreduce_times_partial and sizes[-1] < PARTIAL_RATE_BYTES:
            return None
        if nbytes <= sizes[0] or len(sizes) == 1:
            return times[0]
        if nbytes >= sizes[-1]:
            return times[-1] * nbytes / sizes[-1]
        return float(np.interp(nbytes, sizes, times))

    def to_json(self) -> dict:
        d = asdict(self)
        d["gammas"] = dict(self.gammas)
        d["allreduce_times"] = {name: [list(x) for x in table]
                                for name, table in self.allreduce_times}
        return d

    @classmethod
    def from_json(cls, d: dict) -> Params:
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in d.items() if k in known}
        values["gammas"] = tuple(sorted(dict(values.get("gammas", {})).items()))
        values["allreduce_times"] = tuple(
            (str(name), tuple((float(b), float(t)) for b, t in table))
            for name, table in dict(values.get("allreduce_times", {})).items())
        for curve in ("exchange", "ring_exchange", "ring_reduce_exchange", "copy_curve"):
            values[curve] = tuple((float(b), float(t)) for b, t in values.get(curve, ()))
            if len(values[curve]) == 1:
                raise ModelUnavailable(f"parameter {curve} needs at least two measured sizes")
        params = cls(**values)
        for name in ("alpha", "beta", "gamma", "copy", "copy_cached", "barrier", "call",
                     "handoff", "wait_cpu", "wait_share", "alpha_native"):
            value = getattr(params, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ModelUnavailable(f"parameter {name}={value!r} is not a time >= 0")
        return params


def curve_time(table: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """Seconds at nbytes from measured (bytes, seconds) points: linear between them, the smallest
    size's time below them, the last slope beyond them."""
    sizes = [b for b, _ in table]
    times = [t for _, t in table]
    if nbytes <= sizes[0]:
        return times[0]
    if nbytes >= sizes[-1]:
        slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
        return times[-1] + (nbytes - sizes[-1]) * max(slope, 0.0)
    return float(np.interp(nbytes, sizes, times))


# -- the parameter file ------------------------------------------------------------------------
def default_path() -> str:
    """Where calibrate saves and auto reads: the settings' cost_model (MPDL_COST_MODEL), else
    $XDG_CACHE_HOME/mpdl (~/.cache)."""
    path = settings.current().cost_model
    if path in ("off", "defaults"):
        return settings.default_cost_model_path()
    return path


def read_file(path: str) -> dict:
    """The file's entries by world size ({} when the file does not exist)."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        entries = data["entries"]
        if data.get("version") != FORMAT_VERSION or not isinstance(entries, dict):
            raise ValueError("unknown format")
        return {int(k): Params.from_json(v) for k, v in entries.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelUnavailable(f"{path}: not a usable mpdl cost model ({exc}); "
                               f"rerun `mpdl calibrate`") from None


def save(path: str, params: Params) -> bool:
    """Store params under their world size in path, keeping the entries of other sizes; a
    provisional calibration never replaces one taken on a quiet machine (then False, and the
    file is left as it was)."""
    try:
        entries = read_file(path)
    except ModelUnavailable:
        entries = {}
    held = entries.get(params.ranks)
    if params.provisional and held is not None and not held.provisional:
        return False
    entries[params.ranks] = params
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_open(path) as f:
        json.dump({"version": FORMAT_VERSION,
                   "entries": {str(k): v.to_json() for k, v in sorted(entries.items())}}, f, indent=1)
        f.write("\n")
    forget_loaded()
    return True


def load_params(ranks: int | None = None, path: str | None = None) -> Params:
    """Calibrated parameters for a world of `ranks` (the entry measured at the nearest size; ties go
    to the smaller), or the defaults when nothing was calibrated. ModelUnavailable for a broken file
    or MPDL_COST_MODEL=off."""
    if path is None:
        configured = settings.current().cost_model
        if configured == "off":
            raise ModelUnavailable(f"{ENV}=off")
        if configured == "defaults":
            return Params()
        path = default_path()
    return _load(path, ranks)


@functools.lru_cache(maxsize=16)
def _load(path: str, ranks: int | None) -> Params:
    """Read once per process: a file rewritten during a run must not make ranks disagree."""
    entries = read_file(path)
    if not entries:
        return Params()
    if ranks is None:
        return entries[max(entries)]
    return entries[min(entries, key=lambda k: (abs(k - ranks), k))]


# -- predictions -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One call: p ranks on `nodes` nodes of g consecutive ranks, n bytes of a dtype."""

    p: int
    nodes: int
    n: float
    params: Params
    gamma: float
    seg: int

    @property
    def g(self) -> int:
        return max(1, -(-self.p // max(1, self.nodes)))

    def node(self, rank: int) -> int:
        return rank // self.g

    def msg(self, nbytes: float, inter: bool = False, segmented: bool = False,
            ring: bool = False) -> float:
        """One send of nbytes (in ceil(nbytes/segment) messages when the algorithm segments it),
        as one step round a ring when `ring`."""
        count = max(1, math.ceil(nbytes / self.seg)) if segmented else 1
        if self.params.exchange and not (inter and self.params.alpha_inter is not None):
            return count * self.params.exchange_time(nbytes / count, ring)
        alpha, beta = self.params.link(inter)
        return count * alpha + nbytes * beta

    def crosses(self, a: np.ndarray, b: np.ndarray) -> bool:
        """Does any of the messages between ranks a[i] and b[i] cross a node boundary?"""
        return bool(np.any(a // self.g != b // self.g))


def _fold(s: Setting) -> tuple[int, float]:
    """(power-of-two group size, cost of folding p onto it and back) for recursive algorithms."""
    group = 1 << (s.p.bit_length() - 1)
    if group == s.p:
        return group, 0.0
    r = np.arange(0, 2 * (s.p - group), 2)
    inter = s.crosses(r, r + 1)
    return group, 2 * s.msg(s.n, inter) + s.n * s.gamma


def _pair_crosses(s: Setting, d: int, group: int) -> bool:
    """Does an exchange at distance d inside the power-of-two group cross a node boundary?"""
    rem = s.p - group
    x = np.arange(group)
    y = x ^ d
    x, y = x[y < group], y[y < group]

    def real(v: np.ndarray) -> np.ndarray:
        return np.where(v < rem, 2 * v + 1, v + rem)

    return s.crosses(real(x), real(y))


def recursive_doubling_time(s: Setting) -> float:
    group, t = _fold(s)
    d = 1
    while d < group:
        t += s.msg(s.n, _pair_crosses(s, d, group)) + s.n * s.gamma
        d *= 2
    return t


def rabenseifner_time(s: Setting) -> float:
    group, t = _fold(s)
    d, share = group // 2, s.n
    while d >= 1:
        share /= 2
        inter = _pair_crosses(s, d, group)
        t += s.msg(share, inter) + share * s.gamma  # halving
        t += s.msg(share, inter)  # and the matching doubling step
        d //= 2
    return t


def ring_reduce_scatter_time(s: Setting) -> float:
    inter = s.nodes > 1
    table = s.params.ring_reduce_exchange
    if table and s.gamma and not (inter and s.params.alpha_inter is not None):
        block = s.n / s.p  # the measured step includes the (float32) reduction of its block
        count = max(1, math.ceil(block / s.seg))
        extra = max(0.0, s.gamma - s.params.gamma_for("float32")) * block  # slower dtypes
        return (s.p - 1) * (count * curve_time(table, block / count) + extra)
    return (s.p - 1) * (s.msg(s.n / s.p, inter, segmented=True, ring=True) + s.n / s.p * s.gamma)


def ring_allgather_time(s: Setting) -> float:
    return (s.p - 1) * s.msg(s.n / s.p, s.nodes > 1, ring=True)


def ring_time(s: Setting) -> float:
    return ring_reduce_scatter_time(s) + ring_allgather_time(s)


def _binomial_levels(s: Setting) -> list[bool]:
    """For each level of a binomial tree rooted at rank 0: does it cross a node boundary?"""
    levels, mask = [], 1
    while mask < s.p:
        r = np.arange(0, s.p - mask, 2 * mask)
        levels.append(s.crosses(r, r + mask))
        mask *= 2
    return levels


def tree_reduce_time(s: Setting) -> float:
    # The root takes one message per level and segment, and reduces each.
    return sum(s.msg(s.n, inter, segmented=True) + s.n * s.gamma for inter in _binomial_levels(s))


def tree_broadcast_time(s: Setting) -> float:
    return sum(s.msg(s.n, inter, segmented=True) for inter in _binomial_levels(s))


def tree_time(s: Setting) -> float:
    return tree_reduce_time(s) + tree_broadcast_time(s)


def double_tree_time(s: Setting) -> float:
    if s.p == 1:
        return 0.0
    height = s.p.bit_length() - 1  # edges from the root to the deepest leaf
    children = min(2, s.p - 1)
    half, inter = s.n / 2, s.nodes > 1
    up = children * (s.msg(half, inter, segmented=True) + half * s.gamma)
    down = s.msg(half, inter, segmented=True)
    return height * (up + down)


def _sub(s: Setting, p: int, n: float, nodes: int) -> Setting:
    return replace(s, p=p, n=n, nodes=nodes)


def _inter_node(s: Setting, shard: float, m: int) -> float:
    """The all-reduce among m node representatives (each on its own node)."""
    sub = _sub(s, m, shard, m)
    return recursive_doubling_time(sub) if shard < INTER_RING_BYTES else ring_time(sub)


def hierarchical_time(s: Setting) -> float:
    if s.nodes <= 1:
        return ring_time(s)
    g, m = s.g, s.nodes
    local = _sub(s, g, s.n, 1)
    if s.p % m:  # uneven nodes: reduce to node leaders, all-reduce them, broadcast
        return tree_reduce_time(local) + _inter_node(s, s.n, m) + tree_broadcast_time(local)
    return (ring_reduce_scatter_time(local) + _inter_node(s, s.n / g, m)
            + ring_allgather_time(local))


def torus2d_time(s: Setting) -> float:
    if s.p == 1:
        return 0.0
    nx, ny = grid_shape(s.p)
    rows_intra = s.nodes <= 1 or (nx <= s.g and s.g % nx == 0)
    row = _sub(s, nx, s.n, 1 if rows_intra else nx)
    column = _sub(s, ny, s.n / nx, 1 if s.nodes <= 1 else ny)
    return ring_reduce_scatter_time(row) + ring_time(column) + ring_allgather_time(row)


def shm_time(s: Setting) -> float:
    if s.p == 1:
        return 0.0
    g, m = s.g, max(1, s.nodes)
    c = s.params.copy_cached or s.params.copy  # the window chunks stay in cache
    gamma = s.gamma * c / s.params.copy if s.params.copy else s.gamma
    chunks = max(1, math.ceil(s.n / WINDOW_BYTES))
    inter = 0.0 if m == 1 else _inter_node(s, s.n / g, m)
    # copy in, reduce this rank's slice in place (g-1 additions), copy the whole result out
    return chunks * 2 * s.params.barrier + 2 * s.n * c + (g - 1) / g * s.n * gamma + inter


def _native(s: Setting) -> Setting:
    """The setting for the MPI library's own algorithms: its latency, no Python, no segments."""
    a_in, a_out = s.params.link(False)[0], s.params.link(True)[0]
    extra = a_out - a_in  # what a slower inter-node link adds to every message
    return replace(s, params=replace(s.params, alpha=s.params.alpha_native,
                                     alpha_inter=s.params.alpha_native + extra), seg=1 << 62)




def mpi_alltoall_time(s: Setting) -> float:
    """MPICH's choice by bytes per destination, timed with the library's own latency."""
    native = _native(s)
    per_destination = s.n / s.p
    if per_destination <= MPICH_ALLTOALL_SHORT_BYTES and s.p >= 8:
        return bruck_alltoall_time(native)
    if per_destination <= MPICH_ALLTOALL_MEDIUM_BYTES:
        return scattered_alltoall_time(native)
    return pairwise_alltoall_time(native)


def mpi_allreduce_time(s: Setting) -> float:
    """MPICH: recursive doubling for short messages, Rabenseifner for long ones."""
    native = _native(s)
    if s.n <= MPICH_SHORT_BYTES:
        return recursive_doubling_time(native)
    return rabenseifner_time(native)


# -- all-to-all: n is what each rank sends in all (its own block included), n/p per destination --
def _step_crosses(s: Setting, dst: np.ndarray) -> bool:
    """Does any rank's message of one step (rank r to dst[r]) cross a node boundary?"""
    return s.crosses(np.arange(s.p), dst)


def pairwise_alltoall_time(s: Setting) -> float:
    """p-1 exchanges of one block, one after another, and the local copy of this rank's own."""
    block, ranks = s.n / s.p, np.arange(s.p)
    power_of_two = s.p & (s.p - 1) == 0
    steps = 0.0
    for i in range(1, s.p):
        dst = ranks ^ i if power_of_two else (ranks + i) % s.p
        steps += s.msg(block, _step_crosses(s, dst))
    return steps + s.params.copy_time(block)


def bruck_alltoall_time(s: Setting) -> float:
    """ceil(lg p) steps, step k carrying the blocks whose index has bit k set (about n/2), each
    packed before and unpacked after; a rotation of the whole array before and after."""
    block, ranks = s.n / s.p, np.arange(s.p)
    t = 2 * s.params.copy_time(s.n)
    distance = 1
    while distance < s.p:
        moved = sum(1 for i in range(s.p) if i & distance) * block
        t += s.msg(moved, _step_crosses(s, (ranks + distance) % s.p))
        t += 2 * s.params.copy_time(moved)
        distance *= 2
    return t


#: what posting one more non-blocking message of a batch costs, as a share of α (the scattered
#: algorithm's messages overlap their latencies but each is still posted and completed in turn)
POST_SHARE = 0.5


def scattered_alltoall_time(s: Setting) -> float:
    """Batches of THROTTLE peers: one α per batch, a posting cost for each further message, the
    bytes of all p-1 blocks, and the local copy of this rank's own block. α is the link's, or the
    latency of the message curve the messages are timed by (a calibration's measured exchange)
    when that is less: a posting never costs more than its share of a message."""
    block = s.n / s.p
    batches = math.ceil((s.p - 1) / THROTTLE)
    inter = s.nodes > 1
    latency = s.msg(0, inter)
    alpha = min(s.params.link(inter)[0], latency)
    return (batches * s.msg(block, inter) + (s.p - 1 - batches) * (POST_SHARE * alpha
            + s.msg(block, inter) - latency) + s.params.copy_time(block))


def hierarchical_alltoall_time(s: Setting) -> float:
    """The four phases of `hierarchical_alltoall` (see its module) on nodes of g ranks."""
    g, m = s.g, max(1, -(-s.p // s.g))
    b = s.n / s.p
    inside = (g - 1) * s.msg(b) + s.params.copy_time(b)
    if m == 1:
        return inside
    served = math.ceil((m - 1) / g)
    gather = (m - 1) * s.msg(0) + (m - 1) * (g - 1) * (s.msg(b) - s.msg(0))
    across = served * s.msg(g * g * b, inter=True)
    reorder = served * s.params.copy_time(g * g * b)
    return inside + 2 * gather + across + reorder


def tree_reduce_scatter_time(s: Setting) -> float:
    scatter = sum(s.msg(s.n / (2 << i), inter) for i, inter in enumerate(_binomial_levels(s)))
    return tree_reduce_time(s) + scatter


def tree_allgather_time(s: Setting) -> float:
    gather = sum(s.msg(s.n / (2 << i), inter) for i, inter in enumerate(_binomial_levels(s)))
    return gather + tree_broadcast_time(s)


def ring_broadcast_time(s: Setting) -> float:
    if s.p == 1:
        return 0.0
    k = max(1, math.ceil(s.n / s.seg))
    return (k + s.p - 2) * s.msg(min(s.n, s.seg), s.nodes > 1)


def ring_reduce_time(s: Setting) -> float:
    if s.p == 1:
        return 0.0
    return ring_reduce_scatter_time(s) + s.msg(s.n * (s.p - 1) / s.p, s.nodes > 1)


def _shift_crosses(s: Setting, d: int) -> bool:
    """Does a message from every rank r to rank r+d (mod p) cross a node boundary?"""
    r = np.arange(s.p)
    return s.crosses(r, (r + d) % s.p)


def recursive_doubling_allgather_time(s: Setting) -> float:
    group = 1 << (s.p.bit_length() - 1)
    t = 0.0 if group == s.p else s.msg(s.n / s.p) + s.msg(s.n)  # fold in one block, out all
    d = 1
    while d < group:
        t += s.msg(s.n * d / group, _pair_crosses(s, d, group))
        d *= 2
    return t


def bruck_allgather_time(s: Setting) -> float:
    t, d = 2 * s.params.copy_time(s.n) if s.p > 1 else 0.0, 1
    while d < s.p:
        t += s.msg(s.n * min(d, s.p - d) / s.p, _shift_crosses(s, d))
        d *= 2
    return t


def _pat_steps(s: Setting) -> list[tuple[int, int]]:
    """(distance, blocks) of each PAT step, farthest first (the all-gather's order)."""
    steps, d = [], 1
    while d < s.p:
        steps.append((d, len(range(0, s.p - d, 2 * d))))
        d *= 2
    return steps[::-1]


def _pat_time(s: Setting) -> float:
    block = s.n / s.p
    per_message = max(1, int(s.seg // max(block, 1.0)))
    t = 2 * s.params.copy_time(s.n * (s.p - 1) / s.p)  # packing and unpacking
    for d, blocks in _pat_steps(s):
        full, rest = divmod(blocks, per_message)
        inter = _shift_crosses(s, d)
        t += full * s.msg(per_message * block, inter) + (rest > 0) * s.msg(rest * block, inter)
    return t + s.n * (s.p - 1) / s.p * s.gamma


def recursive_halving_time(s: Setting) -> float:
    group, fold = _fold(s)
    t = 0.0 if group == s.p else fold / 2 + s.msg(s.n / s.p)  # whole buffer in, one block out
    d, share = group // 2, s.n
    while d >= 1:
        share /= 2
        t += s.msg(share, _pair_crosses(s, d, group)) + share * s.gamma
        d //= 2
    return t


def pairwise_reduce_scatter_time(s: Setting) -> float:
    block = s.n / s.p
    return sum(s.msg(block, _shift_crosses(s, i)) + block * s.gamma for i in range(1, s.p))


def binomial_broadcast_time(s: Setting) -> float:
    return sum(s.msg(s.n, inter) for inter in _binomial_levels(s))


def binomial_reduce_time(s: Setting) -> float:
    return sum(s.msg(s.n, inter) + s.n * s.gamma for inter in _binomial_levels(s))


def _binomial_blocks_time(s: Setting) -> float:
    """A binomial scatter or gather of p blocks: level i moves n/2^(i+1)."""
    return sum(s.msg(s.n / (2 << i), inter) for i, inter in enumerate(_binomial_levels(s)))


def scatter_allgather_broadcast_time(s: Setting) -> float:
    return _binomial_blocks_time(s) + ring_allgather_time(s)


def reduce_scatter_gather_time(s: Setting) -> float:
    return recursive_halving_time(s) + _binomial_blocks_time(s)


FORMULAS: dict[str, dict[str, Callable[[Setting], float]]] = {
    "allreduce": {"ring": ring_time, "recursive_doubling": recursive_doubling_time,
                  "rabenseifner": rabenseifner_time, "tree": tree_time,
                  "double_tree": double_tree_time, "hierarchical": hierarchical_time,
                  "torus2d": torus2d_time, "shm": shm_time, "mpi": mpi_allreduce_time},
    "reduce_scatter": {"ring": ring_reduce_scatter_time, "tree": tree_reduce_scatter_time,
                       "recursive_halving": recursive_halving_time,
                       "pairwise": pairwise_reduce_scatter_time, "pat": _pat_time,
                       "mpi": lambda s: ring_reduce_scatter_time(_native(s))},
    "allgather": {"ring": ring_allgather_time, "tree": tree_allgather_time,
                  "recursive_doubling": recursive_doubling_allgather_time,
                  "bruck": bruck_allgather_time, "pat": _pat_time,
                  "mpi": lambda s: ring_allgather_time(_native(s))},
    "broadcast": {"ring": ring_broadcast_time, "tree": tree_broadcast_time,
                  "binomial": binomial_broadcast_time,
                  "scatter_allgather": scatter_allgather_broadcast_time,
                  "mpi": lambda s: tree_broadcast_time(_native(s))},
    "reduce": {"ring": ring_reduce_time, "tree": tree_reduce_time,
               "binomial": binomial_reduce_time,
               "reduce_scatter_gather": reduce_scatter_gather_time,
               "mpi": lambda s: tree_reduce_time(_native(s))},
    "alltoall": {"pairwise": pairwise_alltoall_time, "bruck": bruck_alltoall_time,
                 "scattered": scattered_alltoall_time, "hierarchical": hierarchical_alltoall_time,
                 "mpi": mpi_alltoall_time},
}


def _check_formulas() -> None:
    """Every formula belongs to a registered algorithm (an algorithm without one is estimated from
    its message log)."""
    for collective, formulas in FORMULAS.items():
        unknown = set(formulas) - set(registry.REGISTRY.get(collective, ()))
        if unknown:
            raise RuntimeError(f"costmodel.FORMULAS[{collective!r}] names algorithms the registry "
                               f"does not have: {sorted(unknown)}")


_check_formulas()

#: collectives that combine data (γ applies)
_REDUCING = {"allreduce", "reduce_scatter", "reduce"}


def predict(collective: str, algorithm: str, nbytes: int, p: int, nodes: int = 1,
            params: Params | None = None, dtype: str = "float32") -> float:
    """Predicted seconds of one call: `nbytes` is the whole array (the result, for allgather)."""
    params = Params() if params is None else params
    itemsize = np.dtype(dtype).itemsize
    s = Setting(p=max(1, p), nodes=max(1, min(nodes, p)), n=float(nbytes), params=params,
                gamma=params.gamma_for(dtype) if collective in _REDUCING else 0.0,
                seg=segment_elements(itemsize) * itemsize)
    formula = FORMULAS.get(collective, {}).get(algorithm)
    measured = (params.measured_time(algorithm, nbytes, s.p, s.nodes)
                if collective == "allreduce" and s.p > 1 else None)
    if measured is not None:  # measured with the input copy, as the API makes it
        return params.call + measured
    if formula is None:
        registry.resolve(collective, algorithm)  # ValueError for unknown names
        body = logged_estimate(collective, algorithm, nbytes, s.p, s.nodes, params, dtype)
    else:
        body = formula(s) if s.p > 1 else 0.0
    # the API copies the input into the result first, unless the algorithm reads it directly
    reads_input = registry.REGISTRY[collective][algorithm].reads_input
    return params.call + (0.0 if reads_input else params.copy_time(nbytes)) + body


# -- estimates from a message log ---------------------------------------------------------------
#: the largest array the in-process world runs to log its messages; bigger ones are scaled
LOG_SAMPLE_BYTES = 1 << 16


@functools.lru_cache(maxsize=256)
def _logged_messages(collective: str, algorithm: str, p: int, ranks_per_node: int, count: int,
                     dtype: str) -> tuple[tuple[int, int, int], ...]:
    """The (src, dst, bytes) of every message, sorted, from one run of the registered algorithm on
    the in-process world (the messages the public call sends: it checks, copies, then runs it)."""
    run = registry.REGISTRY[collective][algorithm].run

    def call(comm):
        x = np.ones(count, dtype=dtype)
        if collective == "allreduce":
            run(comm, x, "sum")
        elif collective == "reduce_scatter":
            run(comm, x, "sum", block_bounds(count, p))
        elif collective == "allgather":  # every rank's max(1, count // p) elements
            part = max(1, count // p)
            run(comm, np.ones(part * p, dtype=dtype), [i * part for i in range(p + 1)])
        elif collective == "broadcast":
            run(comm, x, 0)
        else:
            run(comm, x, "sum", 0)

    _, log = run_world(p, call, ranks_per_node=ranks_per_node, message_log=True)
    return tuple(sorted((src, dst, nbytes) for _, _, src, dst, nbytes in log))


def logged_estimate(collective: str, algorithm: str, nbytes: int, p: int, nodes: int,
                    params: Params, dtype: str = "float32") -> float:
    """The busiest rank's messages (α + bytes·β each, γ on what it receives when reducing), from
    the message log of a run at min(nbytes, LOG_SAMPLE_BYTES) and scaled to nbytes."""
    if p == 1:
        return 0.0
    itemsize = np.dtype(dtype).itemsize
    sample = max(itemsize * p, min(nbytes, LOG_SAMPLE_BYTES))
    g = max(1, -(-p // max(1, nodes)))
    rows = _logged_messages(collective, algorithm, p, g, sample // itemsize, np.dtype(dtype).name)
    scale = nbytes / sample
    gamma = params.gamma_for(dtype) if collective in _REDUCING else 0.0
    busy = [0.0] * p
    for src, dst, b in rows:
        alpha, beta = params.link(src // g != dst // g)
        busy[src] += alpha + b * scale * beta
        busy[dst] += b * scale * gamma
    return max(busy)


# -- auto --------------------------------------------------------------------------------------
def candidates(collective: str, shared_memory: bool) -> list[str]:
    """The algorithms auto may pick: every hand-written one (not the MPI baseline); shm only where
    the communicator has shared memory."""
    return [name for name, algo in registry.REGISTRY[collective].items()
            if not algo.baseline and (name != "shm" or shared_memory)]


def fastest(collective: str, nbytes: int, p: int, nodes: int, shared_memory: bool,
           params: Params | None = None, dtype: str = "float32") -> str:
    """The algorithm with the smallest predicted time (ties: the one registered first)."""
    params = Params() if params is None else params
    names = candidates(collective, shared_memory)
    times = [predict(collective, name, nbytes, p, nodes, params, dtype) for name in names]
    return names[min(range(len(names)), key=lambda i: (times[i], i))]


def current_params(p: int) -> Params:
    """The parameters `auto` uses for a world of p ranks: the file, plus the settings' emulated
    links (MPDL_EMULATE)."""
    return load_params(p).emulated(settings.current().emulation)


#: bumped by forget_loaded(), so that `auto` chooses again with the parameters read afresh
_generation = [0]


def generation() -> int:
    """How many times the parameter files were forgotten (auto's choices are valid for one)."""
    return _generation[0]


def forget_loaded() -> None:
    """Drop the loaded parameter files, and with them `auto`'s remembered choices (after writing a
    new parameter file; a settings change needs no forgetting)."""
    _load.cache_clear()
    _generation[0] += 1
