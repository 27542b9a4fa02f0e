"""The `Communicator` interface every collective algorithm is written against, and `SubComm`.

An implementation provides four transport methods (`_isend`, `_irecv`, `_wait_all`, `_test`), the
node layout (`node_of_rank`) and `allgather_object`; shared memory (`shared_segments`) is optional.
This base adds the message log, flight recording, `waitall`/`waitany`/`test`, blocking helpers,
persistent sends and receives (`send_init`/`recv_init`), a barrier, sub-communicators and reusable
buffers.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from mpdl import backend, memory, settings
from mpdl.comm.calls import OBJECT_TAG, CallName, call_state, is_check_tag, tagged

DEFAULT_TIMEOUT_S = settings.Settings.timeout


class CollectiveTimeout(RuntimeError):
    """A point-to-point wait inside a collective took longer than MPDL_TIMEOUT seconds."""

    #: an uncaught one ends the job with its message alone, no traceback (mpdl.mpi_runtime)
    one_line = True


#: whether `check_every_call` is on, per thread (the ranks of an in-process world are threads)
_checking = threading.local()


def check_every_call(on: bool) -> None:
    """Make every communicator check the collectives this thread calls across ranks, as
    MPDL_CHECK=1 does, while on (`mpdl train` turns it on for its first steps). Every rank must
    switch at the same point of its program."""
    _checking.on = on


class CollectiveMismatch(ValueError):
    """Ranks called different collectives, or one with different arguments."""

    one_line = True


#: threads of this process now blocked until background communication finishes, and its lock
_blocked = [0]
_blocked_lock = threading.Lock()


@contextlib.contextmanager
def blocked_on_background() -> Iterator[None]:
    """Mark the calling thread, for the block, as blocked until work on a communication thread
    finishes (`mpdl.comm.handles.Handle.wait`): nobody then needs the GIL or the core that
    a background wait would leave them, and background waits poll without pausing."""
    with _blocked_lock:
        _blocked[0] += 1
    try:
        yield
    finally:
        with _blocked_lock:
            _blocked[0] -= 1


def background_is_awaited() -> bool:
    """Whether some thread of this process is blocked until background communication finishes."""
    return _blocked[0] > 0


def timeout_s() -> float:
    """The wait timeout in seconds (settings: MPDL_TIMEOUT, default 300)."""
    return settings.current().timeout


class Request:
    """A pending send or receive: the peer and step it belongs to, and what to do on completion.

    `handle` is one transport handle, or a list of them for a message sent in chunks; `progress`,
    when given, is called while waiting (a staged receive uploads the chunks that have arrived)."""

    __slots__ = ("handle", "peer", "step", "kind", "on_complete", "progress", "flight")

    def __init__(self, handle: Any, peer: int, step: Any, kind: str,
                 on_complete: Callable[[], None] | None = None,
                 progress: Callable[[], None] | None = None):
        self.handle = handle
        self.peer = peer
        self.step = step
        self.kind = kind
        self.on_complete = on_complete
        self.progress = progress
        #: the flight recorder's entry of a send or receive made outside a collective
        self.flight: list | None = None


class PersistentRequest(Request):
    """A send or receive of one buffer with one peer, made once and started again and again (as
    MPI's Send_init / Recv_init): `start()`, then wait for it as for any request (`waitall`,
    `test`, `waitany`). Starting it again before a wait or test saw it complete raises
    RuntimeError. Over MPI it is one persistent MPI request (`free()` releases it, done at exit
    for those still alive); elsewhere each start posts an ordinary send or receive."""

    __slots__ = ("comm", "buf", "active", "persistent", "_inner", "__weakref__")

    def __init__(self, comm: Communicator, buf: Any, peer: int, step: Any, kind: str) -> None:
        super().__init__(None, peer, step, kind)
        self.comm, self.buf, self.active = comm, buf, False
        self._inner: Callable[[], None] | None = None
        #: the transport's persistent handle, or None (each start posts an ordinary message)
        self.persistent: Any = None
        comm._persistent(self)

    def start(self) -> PersistentRequest:
        """Start the send or receive; returns the request."""
        comm = self.comm
        if self.active:
            where = "to" if self.kind == "send" else "from"
            raise RuntimeError(f"persistent {self.kind} {where} rank {comm.world_rank(self.peer)} "
                               f"(step {self.step}) started again before a wait saw it complete; "
                               f"wait for it (comm.waitall) before starting it again")
        if self.kind == "send" and comm.message_log is not None:
            comm.message_log.append((comm.collective, self.step, comm.world_rank(comm.rank),
                                  comm.world_rank(self.peer), self.buf.nbytes))
        comm._start(self)
        self.active = True
        self.on_complete = self._complete
        if comm.flight is not None and comm.collective == "p2p":
            self.flight = comm._flight_p2p(self.kind, self.buf, self.peer)
        return self

    def _complete(self) -> None:
        self.active = False
        inner, self._inner = self._inner, None
        if inner is not None:
            inner()

    def free(self) -> None:
        """Release the transport's persistent handle (later starts post ordinary messages)."""
        self.comm._free_persistent(self)

    def __del__(self) -> None:
        if self.persistent is not None:
            try:
                self.free()
            except Exception:  # noqa: BLE001 - nothing to do about it at collection time
                pass


class Communicator:
    """The interface every collective algorithm is written against.

    Subclasses provide `_isend`, `_irecv`, `_wait_all`, `_test`, `node_of_rank` and
    `allgather_object` (and `shared_segments` where the ranks of a node share memory); this base
    adds the message
    log, blocking helpers, a barrier, sub-communicators and reusable work buffers. It holds the
    settings it was built with (`settings`: timeout, argument checks, staging, nodes, links).
    """

    rank: int
    size: int
    #: the collective now running, for error messages and the message log (set by mpdl.collectives)
    collective: str = "p2p"
    #: when a list, every message sent is appended as (collective, step, src, dst, nbytes)
    #: (the algorithms' messages: not mpdl's own exchanges that check calls, `is_check_tag`)
    message_log: list | None = None
    #: the flight recorder of this process (mpdl.comm.flight), or None
    flight: Any = None
    #: the communication thread of mpdl.comm.handles (started on first asynchronous call)
    _comm_thread: Any = None

    def __init__(self) -> None:
        self._workspace: dict[Any, Any] = {}
        self._subcomms: dict[Any, SubComm] = {}
        #: the settings this communicator was built with (timeout, check, staging, nodes, links)
        self.settings = settings.current()
        self.timeout = self.settings.timeout
        #: MPDL_CHECK=1: compare every collective's arguments across ranks before it runs
        self._check = self.settings.check
        self._groups: list[list[int]] | None = None

    @property
    def check(self) -> bool:
        """Whether each collective first compares its arguments across the ranks (MPDL_CHECK=1,
        or every communicator while `check_every_call` is on)."""
        return self._check or getattr(_checking, "on", False)

    @check.setter
    def check(self, value: bool) -> None:
        self._check = value

    # -- the transport (what an implementation provides) ---------------------------------------
    def _isend(self, buf: Any, dest: int, step: Any) -> Request:
        """Start sending the contiguous array buf to rank dest; return its request."""
        raise NotImplementedError

    def _irecv(self, buf: Any, source: int, step: Any) -> Request:
        """Start receiving from rank source into the contiguous array buf; return its request."""
        raise NotImplementedError

    def _wait_all(self, requests: Sequence[Request]) -> None:
        """Block until every request's transfer is done (calling each one's `progress` while
        waiting); raise `_timeout_error(pending)` after `self.timeout` seconds."""
        raise NotImplementedError

    def _test(self, request: Request) -> bool:
        """Whether the request's transfer is done (never blocks; a receive that is done has landed
        in its buffer, but its `on_complete` has not run)."""
        raise NotImplementedError

    # -- point to point ------------------------------------------------------------------------
    def isend(self, buf: Any, dest: int, step: Any = None) -> Request:
        """Start sending the contiguous array buf to rank dest."""
        if self.message_log is not None and not is_check_tag(call_state.tag):
            self.message_log.append((self.collective, step, self.world_rank(self.rank),
                                  self.world_rank(dest), buf.nbytes))
        request = self._isend(buf, dest, step)
        if self.flight is not None and self.collective == "p2p":
            request.flight = self._flight_p2p("send", buf, dest)
        return request

    def irecv(self, buf: Any, source: int, step: Any = None) -> Request:
        """Start receiving from rank source into the contiguous array buf."""
        request = self._irecv(buf, source, step)
        if self.flight is not None and self.collective == "p2p":
            request.flight = self._flight_p2p("recv", buf, source)
        return request

    def send_init(self, buf: Any, dest: int, step: Any = None) -> PersistentRequest:
        """A send of the contiguous array buf to rank dest, started by its `start()` as often as
        needed (each start sends buf's current values)."""
        return PersistentRequest(self, buf, dest, step, "send")

    def recv_init(self, buf: Any, source: int, step: Any = None) -> PersistentRequest:
        """A receive from rank source into the contiguous array buf, started by its `start()`
        as often as needed."""
        return PersistentRequest(self, buf, source, step, "recv")

    def _persistent(self, request: PersistentRequest) -> None:
        """Give the request the transport's persistent handle, where it has one."""

    def _start(self, request: PersistentRequest) -> None:
        """Start a persistent request: here by posting an ordinary send or receive."""
        inner = (self._isend(request.buf, request.peer, request.step) if request.kind == "send"
                 else self._irecv(request.buf, request.peer, request.step))
        request.handle, request.progress, request._inner = (inner.handle, inner.progress,
                                                            inner.on_complete)

    def _free_persistent(self, request: PersistentRequest) -> None:
        """Release the request's persistent handle."""
        request.persistent = None

    def _flight_p2p(self, kind: str, buf: Any, peer: int) -> list:
        me, other = self.world_rank(self.rank), self.world_rank(peer)
        pair = (me, other) if kind == "send" else (other, me)
        return self.flight.begin(pair, kind, "p2p", buf.nbytes, buf.dtype, None, (other,))

    def flight_group(self) -> tuple[int, ...]:
        """The world ranks of this communicator (its collectives' sequence numbers count per
        group)."""
        group = self.__dict__.get("_flight_group")
        if group is None:
            group = self._flight_group = tuple(self.world_rank(r) for r in range(self.size))
        return group

    def waitall(self, requests: Sequence[Request]) -> None:
        """Wait for every request; raise CollectiveTimeout naming the peer and step if one stalls."""
        if requests:
            self._wait_all(requests)
            for r in requests:
                if r.on_complete is not None:
                    r.on_complete()
                if r.flight is not None:
                    self.flight.end(r.flight)
                    r.flight = None

    def test(self, request: Request) -> bool:
        """Whether the request is done; completes it (once) when it is."""
        if not self._test(request):
            return False
        if request.on_complete is not None:
            request.on_complete()
            request.on_complete = None
        if request.flight is not None:
            self.flight.end(request.flight)
            request.flight = None
        return True

    def waitany(self, requests: Sequence[Request]) -> int:
        """Wait until one of the requests is done, complete it and return its index; raise
        CollectiveTimeout naming a peer and step after the timeout. Polls, yielding the core."""
        start = time.monotonic()
        deadline, warned = start + self.timeout, False
        spins = 0
        while True:
            for i, r in enumerate(requests):
                if self.test(r):
                    return i
            spins += 1
            if spins < 2000:
                os.sched_yield()
            else:
                time.sleep(1e-4)
            if spins & 255 == 0:
                now = time.monotonic()
                if now > deadline:
                    raise self._timeout_error(list(requests))
                if not warned and now - start > self.settings.stall_warn:
                    warned = self._stall_warning(list(requests), now - start)

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
        with self.recording("barrier", "dissemination"):
            distance = 1
            while distance < self.size:
                self.sendrecv(token[:1], (self.rank + distance) % self.size,
                              token[1:], (self.rank - distance) % self.size, step="barrier")
                distance *= 2

    @contextlib.contextmanager
    def recording(self, collective: str, algorithm: str, nbytes: int = 0, dtype: str = "",
                  op: str | None = None) -> Iterator[None]:
        """Run the block as one operation `collective` of this communicator: named so in
        timeouts, and one entry of the flight recorder (state failed if the block raises)."""
        previous, self.collective = self.collective, f"{collective}/{algorithm}"
        entry = None
        if self.flight is not None:
            entry = self.flight.begin(self.flight_group(), collective, algorithm, nbytes, dtype,
                                      op, self.flight_group())
        try:
            yield
        except BaseException:
            if entry is not None:
                self.flight.end(entry, "failed")
            raise
        finally:
            self.collective = previous
        if entry is not None:
            self.flight.end(entry)

    def _stall_warning(self, pending: Sequence[Request], waited: float) -> bool:
        """Say once, without stopping, which peers a long wait still waits for (MPDL_STALL_WARN);
        note them in the flight record. Returns True."""
        peers = sorted({self.world_rank(r.peer) for r in pending if r.peer >= 0})
        entry = self.flight.waiting(peers) if self.flight is not None else None
        which = f" (#{entry.seq})" if entry is not None else ""
        whom = ("rank" + ("s " if len(peers) > 1 else " ") + ", ".join(map(str, peers))) \
            if peers else "the other ranks"
        sys.stderr.write(f"mpdl: rank {self.world_rank(self.rank)} has waited {waited:.0f} s in "
                         f"{self.collective}{which} for {whom} (step {pending[0].step}); still "
                         f"waiting (MPDL_STALL_WARN={self.settings.stall_warn:g})\n")
        sys.stderr.flush()
        return True

    def _timeout_error(self, pending: Sequence[Request]) -> CollectiveTimeout:
        if self.flight is not None:
            self.flight.waiting([self.world_rank(r.peer) for r in pending if r.peer >= 0])
        r = pending[0]
        if r.peer < 0 and self.size == 2:  # an MPI collective of two: the other is missing
            peer = f"in {r.step} for rank {self.world_rank(1 - self.rank)}"
        elif r.peer < 0:  # an MPI collective: the library does not say which rank is missing
            peer = f"in {r.step} for the ranks {self._ranks_text()} (one of them never came)"
        else:
            what = "receiving from" if r.kind == "recv" else "sending to"
            peer = f"{what} rank {self.world_rank(r.peer)} at step {r.step}"
        heard = self.heard_text()
        if heard:
            name = self.collective
            mine = name.describe() if isinstance(name, CallName) else name
            heard = f"; this rank is in {mine}, {heard}"
        return CollectiveTimeout(
            f"{self.collective}: rank {self.world_rank(self.rank)} waited more than "
            f"{self.timeout:g} s {peer} (MPDL_TIMEOUT sets the limit){heard}")

    def heard_text(self) -> str:
        """What the other ranks said they wait in, for a timeout's message ("" if nothing)."""
        return ""

    def _ranks_text(self) -> str:
        ranks = [self.world_rank(r) for r in range(self.size)]
        return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) \
            else ", ".join(map(str, ranks))

    # -- structure -------------------------------------------------------------------------------
    def world_rank(self, rank: int) -> int:
        """The rank in the outermost communicator (for messages and the message log)."""
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

    def shared_segments(self, nbytes: int, own: bool = False) -> tuple[list[np.ndarray],
                                                                        Callable[[], None]]:
        """Byte arrays of this node's ranks that all of them can read and write, and a node barrier.

        Collective over the ranks of this rank's node. Segments are cached per size class and
        shared by their callers; with `own`, they are new segments of nbytes that no other call
        returns (collective every time; they live as long as the communicator).
        """
        raise NotImplementedError(f"{type(self).__name__} has no shared memory")

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's obj, in rank order (small Python objects; used for argument checks)."""
        raise NotImplementedError

    def _exchange_objects(self, obj: Any, tag: int) -> list[Any]:
        """Every rank's obj, in rank order: pickled and exchanged point to point under `tag`
        (its size, then its bytes), so that it matches only the same exchange on the others;
        named for timeouts, and no send or receive of a program in the flight records."""
        payload = np.frombuffer(pickle.dumps(obj), np.uint8).copy()
        length = np.array([payload.size], np.int64)
        others = [r for r in range(self.size) if r != self.rank]
        lengths = {r: np.zeros(1, np.int64) for r in others}
        previous = self.collective
        if previous == "p2p":
            self.collective = "allgather_object"
        try:
            with tagged(tag):
                self.waitall([q for r in others for q in (
                    self.isend(length, r, "object size"), self.irecv(lengths[r], r, "object size"))])
                bodies = {r: np.empty(int(lengths[r][0]), np.uint8) for r in others}
                self.waitall([q for r in others for q in (self.isend(payload, r, "object"),
                                                           self.irecv(bodies[r], r, "object"))])
        finally:
            self.collective = previous
        return [obj if r == self.rank else pickle.loads(bodies[r].tobytes())
                for r in range(self.size)]

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
            memory.hold(buf, "communication")
        return buf[:count]


class SubComm(Communicator):
    """A view of some ranks of a parent communicator; messages travel through the parent."""

    def __init__(self, parent: Communicator, ranks: tuple[int, ...]):
        super().__init__()
        self.parent = parent
        self.ranks = ranks
        self.size = len(ranks)
        self.rank = ranks.index(parent.rank)
        self.settings = parent.settings
        self.timeout = parent.timeout
        self._check = parent._check

    @property
    def collective(self) -> str:  # type: ignore[override]
        return self.parent.collective

    @collective.setter
    def collective(self, name: str) -> None:
        self.parent.collective = name

    @property
    def message_log(self) -> list | None:  # type: ignore[override]
        return self.parent.message_log

    @property
    def flight(self) -> Any:  # type: ignore[override]
        return self.parent.flight

    def world_rank(self, rank: int) -> int:
        return self.parent.world_rank(self.ranks[rank])

    def heard_text(self) -> str:
        return self.parent.heard_text()

    def isend(self, buf: Any, dest: int, step: Any = None) -> Request:
        return self.parent.isend(buf, self.ranks[dest], step)

    def irecv(self, buf: Any, source: int, step: Any = None) -> Request:
        return self.parent.irecv(buf, self.ranks[source], step)

    def send_init(self, buf: Any, dest: int, step: Any = None) -> PersistentRequest:
        return self.parent.send_init(buf, self.ranks[dest], step)

    def recv_init(self, buf: Any, source: int, step: Any = None) -> PersistentRequest:
        return self.parent.recv_init(buf, self.ranks[source], step)

    def _wait_all(self, requests: Sequence[Request]) -> None:
        self.parent._wait_all(requests)

    def _test(self, request: Request) -> bool:
        return self.parent._test(request)

    def node_of_rank(self) -> list[int]:
        parent_nodes = self.parent.node_of_rank()
        return [parent_nodes[r] for r in self.ranks]

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every member's obj, in member order (only the members call it)."""
        return self._exchange_objects(obj, OBJECT_TAG)
