"""`auto`'s first-use calibration: a short measurement of the cost model's parameters, cached per
machine and world shape, for when nobody has run `mpdl calibrate`.

`measure_quick(comm)` measures with `mpdl.tuning.measuring`'s QUICK effort, written against the
Communicator interface, so that it runs on any MPI-backed communicator (the world, a split, a
sub-communicator of a process grid): one sweep over five message sizes, few repetitions, and no
GEMM peak or MPI-library latency (`mpdl calibrate` measures thoroughly with the same probes). Then
it times every all-reduce algorithm `auto` may pick at ten sizes from 8 B to 64 MiB
(`measuring.allreduce_table`): the cost model interpolates these for this world shape instead of
its formulas, which miss effects such as caches and cores shared by more ranks than they can run.
The whole takes at most about SECONDS: on a busy machine the table times its sizes coarse to fine
and leaves out those its time would not cover (`measuring.TUNE_ORDER`); the model interpolates
between the sizes timed, and beyond the last the formulas predict where it lies below 1 MiB
(`Params.allreduce_times_partial`). Every rank fits the same parameters from the same numbers.
How long it takes:
docs/results/auto.md#the-first-use-calibrations-length. A calibration taken on a busy machine
(`measuring.Busy`) is marked provisional (`Params.provisional` says why, the load among it) and
kept: no run measures it again (`mpdl calibrate` measures anew). A part of the world derives its
parameters from the world's calibration (`derived`).

The result is kept in one JSON file per key (`cache_key`: host, MPI library, world size, ranks per
node, and the communicator's own shape when it is a part of the world) in the settings' `auto_cache`
folder (MPDL_AUTO_CACHE; $XDG_CACHE_HOME/mpdl by default), written atomically, with the choices
that plans verified online (`verified`: collective and size -> algorithm) and, for those verified
on a busy machine, why (`verified_provisional`: the next run verifies them again). `mpdl.tuning.auto`
decides when to read, measure and write (rank 0 decides, every rank follows).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from dataclasses import replace
from typing import Any

import numpy as np

from mpdl import backend
from mpdl.collectives import registry
from mpdl.collectives.ops import check_array, check_op
from mpdl.fileio import atomic_open
from mpdl.threadworld import ThreadWorld
from mpdl.tuning import measuring
from mpdl.tuning.costmodel import ModelUnavailable, Params
from mpdl.tuning.measuring import QUICK, fit, monotone

FORMAT_VERSION = 1
#: the most a first-use calibration takes, its links and rates included: the table leaves out the
#: sizes that would end past it (`measuring.TUNE_ORDER`); a quiet 2-core machine times the whole
#: table within it at 2 and 4 ranks (docs/results/auto.md#the-first-use-calibrations-length)
SECONDS = 8.0


def root_of(comm: Any) -> Any:
    """The world comm is a part of (comm itself when it is the world)."""
    while getattr(comm, "parent", None) is not None:
        comm = comm.parent
    return comm


def _call_overhead() -> float:
    """The public API's fixed cost, near enough: what an all-reduce call of one element does on a
    world of one (check the arguments, allocate and copy the result, run the algorithm). It adds
    the same to every algorithm, so it moves no choice, only `mpdl bench`'s predictions."""
    alone, one = ThreadWorld(1).comm(0), np.ones(1, np.float32)
    ring = registry.REGISTRY["allreduce"]["ring"].run

    def call() -> None:
        check_array(one)
        check_op("sum", one.dtype)
        out = backend.empty_like_page_offset(one)
        np.copyto(out, one)
        ring(alone, out, "sum")

    return measuring.median_time(call, 5, 20)


def measure_quick(comm: Any) -> Params:
    """The cost model's parameters of comm's ranks and links, measured now (collective over comm,
    an MPI-backed communicator of at least two ranks; the same Params on every rank). Emulated
    link delays are lifted while it measures: the model adds them itself. Its collectives are
    left out of the flight records, so that the program's own keep their sequence numbers
    whether or not a calibration ran first."""
    t_start = time.perf_counter()
    root = root_of(comm)
    delay = getattr(root, "link_delay", None)
    previous, recorder = comm.collective, root.flight
    root.link_delay, comm.collective, root.flight = None, "auto first-use calibration", None
    try:
        groups = comm.node_groups()
        here = len(next(g for g in groups if comm.rank in g))
        load_before, since = measuring.load_per_core(here), measuring.clocks()
        curves = measuring.link_curves(comm, QUICK)
        barrier = Params().barrier
        if comm.has_shared_memory:
            # the node barrier the shm algorithm takes twice per call: half an 8-byte shm run
            shm, small = registry.REGISTRY["allreduce"]["shm"].run, np.ones(2, np.float32)
            shm(comm, small, "sum")
            barrier = max(measuring.bench_time(comm, lambda: shm(comm, small, "sum"), 10),
                          1e-7) / 2
        comm.barrier()
        rates = measuring.rates(QUICK)
        rates["call"] = _call_overhead()
        table = measuring.allreduce_table(comm, SECONDS - (time.perf_counter() - t_start))
        busy = measuring.busy_check(comm, load_before, measuring.load_per_core(here), table.spread,
                                    measuring.core_share(since))
        stamp = (socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S"),
                 time.perf_counter() - t_start)
        everyone = comm.allgather_object((rates, stamp))
    finally:
        root.link_delay, comm.collective, root.flight = delay, previous, recorder

    worst = {k: max(r[0][k] for r in everyone) for k in rates}
    intra, inter = curves["intra"], curves["inter"]
    have_pairs = max(intra) > 0
    alpha, beta = fit(QUICK.sizes, intra if have_pairs or inter is None else inter)
    alpha_inter = beta_inter = None
    if inter is not None:
        alpha_inter, beta_inter = fit(QUICK.sizes, inter)
    gammas = tuple(sorted((d, worst[f"gamma:{d}"]) for d in measuring.GAMMA_DTYPES))
    host, when, seconds = everyone[0][1]  # rank 0's, so that every rank has the same Params
    return Params(alpha=alpha, beta=beta, gamma=dict(gammas)["float32"], alpha_inter=alpha_inter,
                  beta_inter=beta_inter, copy=worst["copy"], copy_cached=worst["copy_cached"],
                  barrier=barrier, call=worst["call"], alpha_native=min(alpha, Params().alpha_native),
                  gammas=gammas, ranks=comm.size,
                  exchange=monotone(QUICK.sizes, intra) if have_pairs else (),
                  ring_exchange=monotone(QUICK.sizes, curves["ring"]) if curves["ring"] else (),
                  allreduce_times=table.rows, allreduce_times_partial=table.partial,
                  nodes=len(groups),
                  source=f"first-use calibration on {host}, {comm.size} ranks, {len(groups)} "
                         f"node(s), {when}, {seconds:.2f} s"
                         + (", median rounds (more ranks than cores)" if table.crowded else "")
                         + (f", table of {len(table.rows[0][1])} of {len(measuring.TUNE_SIZES)} "
                            f"sizes, to {int(table.rows[0][1][-1][0])} B ({SECONDS:g} s spent)"
                            if table.partial and table.rows else ""),
                  provisional=busy.why)


def derived(world: Params) -> Params:
    """A part of the world's parameters, from the world's first-use calibration: the same links
    and rates (the cost model predicts the part's shape from them; the world's table of measured
    all-reduce times holds for the world's own shape only)."""
    return replace(world, source=f"derived from the world's {world.source}")


# -- the cache ---------------------------------------------------------------------------------
def cache_key(comm: Any, host: str | None = None, mpi_library: str | None = None) -> dict:
    """What a first-use calibration is valid for: this host, this MPI library, the world's size
    and ranks per node, and comm's own size and ranks per node when comm is a part of the world."""
    root = root_of(comm)
    if mpi_library is None:
        MPI = getattr(root, "MPI", None)
        if MPI is not None:
            from mpdl.mpi_runtime import library_version  # noqa: PLC0415

            mpi_library = library_version(MPI)
        else:
            mpi_library = "none"
    key = {"host": host or socket.gethostname(), "mpi_library": mpi_library,
           "world_size": root.size, "ranks_per_node": [len(g) for g in root.node_groups()]}
    if comm is not root:
        key["comm_size"] = comm.size
        key["comm_ranks_per_node"] = [len(g) for g in comm.node_groups()]
    return key


def cache_path(folder: str, key: dict) -> str:
    """The file of `key` in folder: auto-HOST-pP-NODES[-in-WORLD]-HASH.json."""
    def shape(sizes: list[int]) -> str:
        return "+".join(map(str, sizes)) if len(set(sizes)) > 1 else f"{len(sizes)}x{sizes[0]}"

    host = re.sub(r"[^A-Za-z0-9.-]", "_", key["host"])[:40]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    name = f"auto-{host}-p{key['world_size']}-{shape(key['ranks_per_node'])}"
    if "comm_size" in key:
        name += f"-sub{key['comm_size']}-{shape(key['comm_ranks_per_node'])}"
    return os.path.join(folder, f"{name}-{digest}.json")


def _load(path: str, key: dict) -> dict | None:
    """The file's contents when it is a first-use calibration of key; None when there is no file."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {data.get('version')!r}, expected {FORMAT_VERSION}")
        if data.get("key") != key:
            raise ValueError(f"made for {data.get('key')}, not {key}")
        data["params"] = Params.from_json(data["params"])
        data["verified"] = {str(k): str(v) for k, v in dict(data.get("verified", {})).items()}
        data["unsettled"] = {str(k): str(v) for k, v
                             in dict(data.get("verified_provisional", {})).items()
                             if k in data["verified"]}
        return data
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ModelUnavailable) as exc:
        raise ModelUnavailable(f"{path}: not a usable first-use calibration ({exc})") from None


def read(path: str, key: dict) -> Params | None:
    """The cached parameters of key in path (`provisional` set when taken on a busy machine);
    None when there is no such file. ModelUnavailable, with what is wrong, for a file that is not
    a first-use calibration of key."""
    data = _load(path, key)
    return None if data is None else data["params"]


def read_verified(path: str, key: dict) -> dict[str, str]:
    """The choices plans verified online in path ("collective:bytes" -> algorithm); {} when there
    is no such file or it is not usable."""
    try:
        data = _load(path, key)
    except ModelUnavailable:
        return {}
    return {} if data is None else data["verified"]


def read_unsettled(path: str, key: dict) -> dict[str, str]:
    """The verified choices of path taken on a busy machine, and why ("collective:bytes" -> the
    busy check's reason): provisional, to be verified again; {} when there are none."""
    try:
        data = _load(path, key)
    except ModelUnavailable:
        return {}
    return {} if data is None else data["unsettled"]


def _store(path: str, key: dict, params: Params, verified: dict[str, str],
           unsettled: dict[str, str]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_open(path) as f:
        json.dump({"version": FORMAT_VERSION, "key": key, "params": params.to_json(),
                   "verified": dict(sorted(verified.items())),
                   "verified_provisional": dict(sorted(unsettled.items()))}, f, indent=1)
        f.write("\n")


def write(path: str, key: dict, params: Params) -> bool:
    """Store params for key in path, atomically (a reader sees the old file or the whole new one),
    keeping the verified choices when the world shape's measurement is replaced by a quiet one. A
    provisional calibration never replaces one taken on a quiet machine: then False, and the file
    is left as it was."""
    try:
        held = _load(path, key)
    except ModelUnavailable:
        held = None
    if held is not None and params.provisional and not held["params"].provisional:
        return False
    if held is None:
        _store(path, key, params, {}, {})
    else:
        _store(path, key, params, held["verified"], held["unsettled"])
    return True


def remember(path: str, key: dict, entry: str, algorithm: str, provisional: str = "") -> bool:
    """Note in path that a plan verified `algorithm` as the fastest for `entry` (`auto.verified_key`:
    the collective, the size and where the array lies; the next run's `auto` takes it), with
    `provisional` saying why when the machine was busy (the next run verifies it again). A
    provisional verdict never replaces one taken on a quiet machine: then False, as when path
    holds no calibration of key (nothing written)."""
    try:
        held = _load(path, key)
    except ModelUnavailable:
        return False
    if held is None:
        return False
    verified, unsettled = held["verified"], dict(held["unsettled"])
    if provisional and entry in verified and entry not in unsettled:
        return False
    unsettled.pop(entry, None)
    if provisional:
        unsettled[entry] = provisional
    _store(path, key, held["params"], {**verified, entry: algorithm}, unsettled)
    return True
