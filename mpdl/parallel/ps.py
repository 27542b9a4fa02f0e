"""A parameter server over nonblocking MPI point-to-point messages.

The last `servers` ranks are servers, the others workers. The model's parameters, flattened into
one vector, are split into `servers` contiguous shards (numpy.array_split); server s holds shard s
and runs the optimizer on it. Each step a worker pushes its gradient's shards (Isend to every
server) and pulls fresh shards back (Irecv from every server). A server posts one Irecv from any
source with any tag and handles messages in whatever order they arrive:

* ``sync``: the server waits for every worker's gradient of the round, applies their weighted sum
  as one update (in worker order, so the result does not depend on arrival order), then answers
  all of them: synchronous data-parallel SGD.
* ``async``: each gradient is applied on arrival and the pusher gets the new shard at once.
* ``ssp`` (stale synchronous parallel, Ho et al. 2013): like async, but a worker that has pushed
  c gradients gets its answer only once every unfinished worker has pushed at least c − s; s = 0
  is lock-step, s = ∞ is async.

Staleness of an update = updates applied to the shard since the version the worker computed its
gradient on; every server keeps a histogram. Shutdown: each worker sends DONE to every server
after its last answer; a server leaves its loop when all workers are done, waits for its sends,
and sends its final shard to every worker, so all workers end with the same parameters (rank 0
then broadcasts them to the servers too). Every
wait has the MPDL_TIMEOUT deadline and raises naming the peer instead of hanging.

Messages are raw bytes: a 32-byte header (int64 clock, int64 version, float64 lr, float64 weight)
followed by float32/float64 values.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl.comm import MPIComm, as_communicator, timeout_s

MODES = ("sync", "async", "ssp")
TAG_PUSH, TAG_DONE, TAG_PARAMS, TAG_FINAL = 11, 12, 13, 14
HEADER = 32


def check_config(world_size: int, servers: int, mode: str, staleness: int | None) -> None:
    """ValueError with a one-line message for a parameter-server setup that cannot run."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if world_size < 2:
        raise ValueError(f"--mode ps needs at least 2 ranks (1 server and 1 worker), got "
                         f"{world_size}; launch with mpiexec -n 2 or more")
    if not isinstance(servers, int | np.integer) or not 1 <= servers < world_size:
        raise ValueError(f"--servers: expected 1 to {world_size - 1} (at least one rank must be "
                         f"a worker), got {servers!r}")
    if staleness is not None:
        if mode != "ssp":
            raise ValueError(f"--staleness only applies to the bounded-staleness mode (ssp), "
                             f"not {mode}")
        if not isinstance(staleness, int | np.integer) or staleness < 0:
            raise ValueError(f"--staleness: expected an integer >= 0, got {staleness!r}")


def _wait(requests: list[Any], MPI: Any, what: Callable[[], str], statuses: list | None = None
          ) -> None:
    """Test the requests until all complete, yielding the core; RuntimeError after MPDL_TIMEOUT."""
    deadline = time.monotonic() + timeout_s()
    spins = 0
    while not (MPI.Request.Testall(requests, statuses) if statuses is not None
               else MPI.Request.Testall(requests)):
        spins += 1
        if spins < 2000:
            os.sched_yield()
        else:
            time.sleep(1e-4)
        if spins & 255 == 0 and time.monotonic() > deadline:
            raise RuntimeError(f"parameter server: {what()} took longer than {timeout_s():g} s "
                               f"(MPDL_TIMEOUT sets the limit)")


class ParameterServer:
    """This rank's side of a parameter-server job over `comm` (an mpi4py communicator, default
    MPI.COMM_WORLD). Collective at construction: every rank passes the same model architecture;
    rank 0's parameters become everyone's.

    Servers call `serve(make_optimizer)`; workers call `push_pull(lr, weight)` after each backward
    and `close()` at the end. Both return the same statistics on every rank.
    """

    def __init__(self, module: Any, comm: Any = None, servers: int = 1, mode: str = "sync",
                 staleness: int | None = None) -> None:
        base = as_communicator(comm)
        if not isinstance(base, MPIComm):
            raise TypeError("comm: the parameter server runs over MPI (an mpi4py communicator or "
                            "an mpdl MPIComm), not an in-process world")
        check_config(base.size, servers, mode, staleness)
        self.MPI = base.MPI
        self.comm = base.mpi.Dup()
        self.rank, self.size = base.rank, base.size
        self.link_delay = base.link_delay
        self.servers, self.mode = int(servers), mode
        self.staleness = (0 if mode == "sync" else None if mode == "async"
                          else int(staleness or 0))
        self.workers = self.size - self.servers
        self.is_server = self.rank >= self.workers
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.data.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"module: the parameter server needs one parameter dtype, got "
                             f"{sorted(map(str, dtypes))}")
        self.dtype = np.dtype(dtypes.pop())
        self.count = sum(p.size for p in self.params)
        self.bounds = [int(b) for b in np.linspace(0, self.count, self.servers + 1)
                       .round().astype(np.int64)]
        flat = self._flat(grads=False)
        self.comm.Bcast(flat, root=0)
        self._write(flat)
        self.worker_comm = self.comm.Split(0 if not self.is_server else 1, self.rank)
        self.versions = [0] * self.servers
        self.clock = 0
        self.stats: dict[str, Any] = {}

    # -- helpers ------------------------------------------------------------------------------------
    def _flat(self, grads: bool) -> np.ndarray:
        parts = []
        for p in self.params:
            a = p.grad if grads else p.data
            parts.append(np.zeros(p.size, self.dtype) if a is None
                         else np.asarray(a, dtype=self.dtype).reshape(-1))
        return np.concatenate(parts)

    def _write(self, flat: np.ndarray) -> None:
        offset = 0
        for p in self.params:
            p.data[...] = flat[offset:offset + p.size].reshape(p.shape)
            offset += p.size

    def _message(self, clock: int, version: int, lr: float, weight: float,
                 values: np.ndarray | None) -> np.ndarray:
        body = 0 if values is None else values.nbytes
        buf = np.empty(HEADER + body, np.uint8)
        buf[:16].view(np.int64)[:] = (clock, version)
        buf[16:32].view(np.float64)[:] = (lr, weight)
        if values is not None:
            buf[HEADER:] = values.view(np.uint8)
        return buf

    def _isend(self, buf: np.ndarray, dest: int, tag: int) -> Any:
        if self.link_delay is not None:
            self.link_delay(dest, buf.nbytes)
        return self.comm.Isend([buf, self.MPI.BYTE], dest, tag)

    def server_of(self, rank: int) -> int:
        return rank - self.workers

    # -- worker side ----------------------------------------------------------------------------------
    def push_pull(self, lr: float, weight: float = 1.0) -> None:
        """Send this worker's gradients (p.grad; None counts as zeros) and the learning rate to
        the servers, receive the updated parameters and write them into the module. `weight`
        scales this worker's gradient in the synchronous sum (local batch / global batch)."""
        if self.is_server:
            raise RuntimeError("push_pull: this rank is a server; call serve()")
        grad = self._flat(grads=True)
        sends, recvs, replies = [], [], []
        for s in range(self.servers):
            lo, hi = self.bounds[s], self.bounds[s + 1]
            buf = self._message(self.clock, self.versions[s], lr, weight, grad[lo:hi])
            sends.append((buf, self._isend(buf, self.workers + s, TAG_PUSH)))
            reply = np.empty(HEADER + (hi - lo) * self.dtype.itemsize, np.uint8)
            replies.append(reply)
            recvs.append(self.comm.Irecv([reply, self.MPI.BYTE], self.workers + s, TAG_PARAMS))
        _wait([r for _, r in sends] + recvs, self.MPI,
              lambda: f"worker {self.rank} at step {self.clock} waiting for the servers")
        flat = np.empty(self.count, self.dtype)
        for s, reply in enumerate(replies):
            self.versions[s] = int(reply[:16].view(np.int64)[1])
            flat[self.bounds[s]:self.bounds[s + 1]] = reply[HEADER:].view(self.dtype)
        self._write(flat)
        self.clock += 1

    def close(self) -> dict[str, Any]:
        """Tell the servers this worker is done, receive the final parameters (the same on every
        worker) and return the job's statistics."""
        if self.is_server:
            raise RuntimeError("close: this rank is a server; serve() ends by itself")
        done = [self._message(self.clock, 0, 0.0, 0.0, None) for _ in range(self.servers)]
        reqs = [self._isend(b, self.workers + s, TAG_DONE) for s, b in enumerate(done)]
        replies = [np.empty((self.bounds[s + 1] - self.bounds[s]) * self.dtype.itemsize, np.uint8)
                   for s in range(self.servers)]
        reqs += [self.comm.Irecv([r, self.MPI.BYTE], self.workers + s, TAG_FINAL)
                 for s, r in enumerate(replies)]
        _wait(reqs, self.MPI, lambda: f"worker {self.rank} waiting for the final parameters")
        flat = np.concatenate([r.view(self.dtype) for r in replies])
        self.comm.Bcast(flat, root=0)
        self._write(flat)
        return self._gather_stats({"role": "worker", "rank": self.rank, "steps": self.clock})

    # -- server side ------------------------------------------------------------------------------------
    def serve(self, make_optimizer: Callable[[list[Any]], Any]) -> dict[str, Any]:
        """Run this server until every worker is done; `make_optimizer([shard])` builds the
        optimizer of the shard (an mpdl.autograd.optim optimizer; its lr is set from each push)."""
        from mpdl.autograd.nn import Parameter  # noqa: PLC0415

        if not self.is_server:
            raise RuntimeError("serve: this rank is a worker; call push_pull() and close()")
        MPI, W = self.MPI, self.workers
        s = self.server_of(self.rank)
        lo, hi = self.bounds[s], self.bounds[s + 1]
        shard = Parameter(self._flat(grads=False)[lo:hi].copy())
        optimizer = make_optimizer([shard])
        width = hi - lo
        inbox = np.empty(HEADER + width * self.dtype.itemsize, np.uint8)
        version = 0
        clocks, done = [0] * W, [False] * W
        waiting: set[int] = set()  # workers whose answer is held back (sync round, ssp bound)
        round_grads: dict[int, tuple[np.ndarray, float, float]] = {}
        histogram: Counter = Counter()
        sends: list[tuple[np.ndarray, Any]] = []
        status = MPI.Status()
        started = time.perf_counter()

        def apply(grad: np.ndarray, lr: float) -> None:
            nonlocal version
            optimizer.lr = lr
            shard.grad = grad
            optimizer.step()
            shard.grad = None
            version += 1

        def answer(w: int) -> None:
            buf = self._message(clocks[w], version, 0.0, 0.0, shard.data)
            sends.append((buf, self._isend(buf, w, TAG_PARAMS)))

        def release() -> None:
            live = [clocks[w] for w in range(W) if not done[w]]
            slowest = min(live) if live else None
            for w in sorted(waiting):
                if slowest is None or clocks[w] - slowest <= self.staleness:
                    waiting.discard(w)
                    answer(w)

        while not all(done):
            request = self.comm.Irecv([inbox, MPI.BYTE], MPI.ANY_SOURCE, MPI.ANY_TAG)
            _wait([request], MPI, lambda: f"server {self.rank} waiting for any worker "
                  f"(done: {sum(done)} of {W})", [status])
            w, tag = status.Get_source(), status.Get_tag()
            if tag == TAG_DONE:
                done[w] = True
            elif tag == TAG_PUSH:
                clock, used = (int(v) for v in inbox[:16].view(np.int64))
                lr, weight = (float(v) for v in inbox[16:32].view(np.float64))
                grad = inbox[HEADER:].view(self.dtype).copy()
                clocks[w] = clock + 1
                histogram[version - used] += 1
                if self.mode == "sync":
                    round_grads[w] = (grad, weight, lr)
                    waiting.add(w)
                elif self.mode == "async":
                    apply(grad, lr)
                    answer(w)
                else:
                    apply(grad, lr)
                    waiting.add(w)
            else:
                raise RuntimeError(f"parameter server {self.rank}: unexpected tag {tag} from "
                                   f"rank {w}")
            if self.mode == "sync":
                live = [v for v in range(W) if not done[v]]
                if live and all(v in round_grads for v in live):
                    total = np.zeros(width, self.dtype)
                    for v in sorted(round_grads):
                        grad, weight, _ = round_grads[v]
                        total += self.dtype.type(weight) * grad
                    apply(total, round_grads[live[0]][2])
                    round_grads.clear()
                    for v in sorted(waiting):
                        answer(v)
                    waiting.clear()
            elif self.mode == "ssp":
                release()
            sends = [(b, r) for b, r in sends if not r.Test()]
        _wait([r for _, r in sends], MPI, lambda: f"server {self.rank} finishing its sends")
        final = shard.data.copy()
        _wait([self._isend(final.view(np.uint8), w, TAG_FINAL) for w in range(W)], MPI,
              lambda: f"server {self.rank} sending the final parameters")
        flat = np.empty(self.count, self.dtype)
        self.comm.Bcast(flat, root=0)  # every shard, from worker 0, so servers end complete too
        self._write(flat)
        return self._gather_stats({"role": "server", "rank": self.rank, "updates": version,
                                   "staleness": dict(histogram),
                                   "seconds": time.perf_counter() - started})

    def _gather_stats(self, mine: dict[str, Any]) -> dict[str, Any]:
        everyone = self.comm.allgather(mine)
        histogram: Counter = Counter()
        for entry in everyone:
            histogram.update(entry.get("staleness", {}))
        self.stats = {"mode": self.mode, "servers": self.servers, "workers": self.workers,
                      "staleness_bound": self.staleness,
                      "updates": [e["updates"] for e in everyone if e["role"] == "server"],
                      "worker_steps": [e["steps"] for e in everyone if e["role"] == "worker"],
                      "staleness": dict(sorted(histogram.items()))}
        return self.stats

    def free(self) -> None:
        """Release the duplicated communicators (before MPI finalizes)."""
        self.worker_comm.Free()
        self.comm.Free()


def format_histogram(histogram: dict[int, int]) -> str:
    """'staleness 0: 120 (75.0%), 1: 40 (25.0%)' for a {staleness: count} histogram."""
    total = sum(histogram.values()) or 1
    return "staleness " + ", ".join(f"{k}: {v} ({100 * v / total:.1f}%)"
                                    for k, v in sorted(histogram.items()))
