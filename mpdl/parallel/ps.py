"""A parameter server over the nonblocking point-to-point messages of an mpdl Communicator.

The last `servers` ranks are servers, the others workers. The model's parameters, flattened into
one vector, are split into `servers` contiguous shards (numpy.array_split: the first count % servers
shards are one element longer); server s holds shard s and runs the optimizer on it. Each step a
worker pushes its gradient's shards (isend to every server) and pulls fresh shards back (irecv
from every server). A server keeps one receive posted from every worker that is not done and
handles messages in whatever order they arrive (`waitany`):

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
then broadcasts them to the servers too). Every wait has the communicator's timeout (MPDL_TIMEOUT)
and raises CollectiveTimeout naming the peer instead of hanging; emulated links slow the messages
as they slow every message of the communicator.

Messages are raw bytes of one size per shard: a 40-byte header (int64 kind, clock and version,
float64 lr and weight) followed by the shard's float32/float64 values. Messages between two ranks
arrive in the order they were sent, which is all the protocol needs to tell them apart.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl.autograd.nn import Parameter
from mpdl.collectives import broadcast
from mpdl.collectives.ops import block_bounds
from mpdl.comm import Communicator, Request, as_communicator
from mpdl.parallel.flat import pack, unpack

PS_MODES = ("sync", "async", "ssp")
#: what a message is (the header's first field)
PUSH, DONE, PARAMS, FINAL = 1, 2, 3, 4
HEADER = 40


def check_config(world_size: int, servers: int, mode: str, staleness: int | None) -> None:
    """ValueError with a one-line message for a parameter-server setup that cannot run."""
    if mode not in PS_MODES:
        raise ValueError(f"mode: expected one of {', '.join(PS_MODES)}, got {mode!r}")
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


class ParameterServer:
    """This rank's side of a parameter-server job over `comm` (an mpdl Communicator or an mpi4py
    communicator, default MPI.COMM_WORLD). Collective at construction: every rank passes the same
    model architecture; rank 0's parameters become everyone's.

    Servers call `serve(make_optimizer)`; workers call `push_pull(lr, weight)` after each backward
    and `close()` at the end. Both return the same statistics on every rank. The job's messages
    travel on comm: no other point-to-point traffic may use it while the job runs.
    """

    def __init__(self, module: Any, comm: Any = None, servers: int = 1, mode: str = "sync",
                 staleness: int | None = None) -> None:
        self.comm: Communicator = as_communicator(comm)
        check_config(self.comm.size, servers, mode, staleness)
        self.rank, self.size = self.comm.rank, self.comm.size
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
        self.bounds = block_bounds(self.count, self.servers)
        self._write(broadcast(self._flat(grads=False), root=0, comm=self.comm))
        role = range(self.workers, self.size) if self.is_server else range(self.workers)
        #: the ranks of this rank's role (the workers, or the servers) as an mpdl sub-communicator
        self.group = self.comm.sub(role)
        self.versions = [0] * self.servers
        self.clock = 0
        self.stats: dict[str, Any] = {}

    # -- helpers ------------------------------------------------------------------------------------
    def _flat(self, grads: bool) -> np.ndarray:
        """The parameters (or their gradients, zeros where there is none) as one host array."""
        arrays = [p.grad if grads else p.data for p in self.params]
        return pack([np.zeros(p.shape, self.dtype) if a is None else np.asarray(a, dtype=self.dtype)
                     for p, a in zip(self.params, arrays, strict=True)])

    def _write(self, flat: np.ndarray) -> None:
        for p, piece in zip(self.params, unpack(flat, self.params), strict=True):
            p.data[...] = piece

    def _width(self, server: int) -> int:
        return self.bounds[server + 1] - self.bounds[server]

    def _message(self, kind: int, server: int, clock: int = 0, version: int = 0, lr: float = 0.0,
                 weight: float = 0.0, values: np.ndarray | None = None) -> np.ndarray:
        """A message to or from `server`: the header, then its shard's values (zeros if None)."""
        buf = np.zeros(HEADER + self._width(server) * self.dtype.itemsize, np.uint8)
        buf[:24].view(np.int64)[:] = (kind, clock, version)
        buf[24:40].view(np.float64)[:] = (lr, weight)
        if values is not None:
            buf[HEADER:] = values.view(np.uint8)
        return buf

    def _wait(self, requests: list[Request], any_of: bool = False) -> int | None:
        """waitall (or waitany) on the job's requests; a timeout names the parameter server."""
        previous, self.comm.collective = self.comm.collective, f"parameter server/{self.mode}"
        try:
            if any_of:
                return self.comm.waitany(requests)
            self.comm.waitall(requests)
            return None
        finally:
            self.comm.collective = previous

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
        pushes, replies, requests = [], [], []
        for s in range(self.servers):
            lo, hi = self.bounds[s], self.bounds[s + 1]
            pushes.append(self._message(PUSH, s, self.clock, self.versions[s], lr, weight,
                                        grad[lo:hi]))
            replies.append(self._message(PARAMS, s))
            requests.append(self.comm.isend(pushes[-1], self.workers + s, self.clock))
            requests.append(self.comm.irecv(replies[-1], self.workers + s, self.clock))
        self._wait(requests)
        flat = np.empty(self.count, self.dtype)
        for s, reply in enumerate(replies):
            self.versions[s] = int(reply[:24].view(np.int64)[2])
            flat[self.bounds[s]:self.bounds[s + 1]] = reply[HEADER:].view(self.dtype)
        self._write(flat)
        self.clock += 1

    def close(self) -> dict[str, Any]:
        """Tell the servers this worker is done, receive the final parameters (the same on every
        worker) and return the job's statistics."""
        if self.is_server:
            raise RuntimeError("close: this rank is a server; serve() ends by itself")
        done = [self._message(DONE, s, self.clock) for s in range(self.servers)]
        finals = [self._message(FINAL, s) for s in range(self.servers)]
        requests = [self.comm.isend(b, self.workers + s, "done") for s, b in enumerate(done)]
        requests += [self.comm.irecv(b, self.workers + s, "final") for s, b in enumerate(finals)]
        self._wait(requests)
        flat = np.concatenate([b[HEADER:].view(self.dtype) for b in finals])
        self._write(broadcast(flat, root=0, comm=self.comm))
        return self._gather_stats({"role": "worker", "rank": self.rank, "steps": self.clock})

    # -- server side ------------------------------------------------------------------------------------
    def serve(self, make_optimizer: Callable[[list[Any]], Any]) -> dict[str, Any]:
        """Run this server until every worker is done; `make_optimizer([shard])` builds the
        optimizer of the shard (an mpdl.autograd.optim optimizer; its lr is set from each push)."""
        if not self.is_server:
            raise RuntimeError("serve: this rank is a worker; call push_pull() and close()")
        W = self.workers
        s = self.server_of(self.rank)
        lo, hi = self.bounds[s], self.bounds[s + 1]
        shard = Parameter(self._flat(grads=False)[lo:hi].copy())
        optimizer = make_optimizer([shard])
        width = hi - lo
        inboxes = [self._message(PUSH, s) for _ in range(W)]
        posted = {w: self.comm.irecv(inboxes[w], w, "push") for w in range(W)}
        version, last = 0, -1
        clocks, done = [0] * W, [False] * W
        waiting: set[int] = set()  # workers whose answer is held back (sync round, ssp bound)
        round_grads: dict[int, tuple[np.ndarray, float, float]] = {}
        histogram: Counter = Counter()
        sends: list[tuple[np.ndarray, Request]] = []
        started = time.perf_counter()

        def apply(grad: np.ndarray, lr: float) -> None:
            nonlocal version
            optimizer.lr = lr
            shard.grad = grad
            optimizer.step()
            shard.grad = None
            version += 1

        def answer(w: int) -> None:
            buf = self._message(PARAMS, s, clocks[w], version, values=shard.data)
            sends.append((buf, self.comm.isend(buf, w, clocks[w])))

        def release() -> None:
            live = [clocks[w] for w in range(W) if not done[w]]
            slowest = min(live) if live else None
            for w in sorted(waiting):
                if slowest is None or clocks[w] - slowest <= self.staleness:
                    waiting.discard(w)
                    answer(w)

        while not all(done):
            # every worker's next message, starting after the one served last (no worker starves)
            order = sorted(posted, key=lambda v: (v - last - 1) % W)
            w = last = order[self._wait([posted[v] for v in order], any_of=True)]
            inbox = inboxes[w]
            kind, clock, used = (int(v) for v in inbox[:24].view(np.int64))
            if kind == DONE:
                done[w] = True
                del posted[w]
            elif kind == PUSH:
                lr, weight = (float(v) for v in inbox[24:40].view(np.float64))
                grad = inbox[HEADER:].view(self.dtype).copy()
                posted[w] = self.comm.irecv(inbox, w, clock + 1)
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
                raise RuntimeError(f"parameter server {self.rank}: unexpected message kind {kind} "
                                   f"from rank {w}")
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
            sends = [(b, r) for b, r in sends if not self.comm.test(r)]
        self._wait([r for _, r in sends])
        finals = [self._message(FINAL, s, values=shard.data) for _ in range(W)]
        self._wait([self.comm.isend(b, w, "final") for w, b in enumerate(finals)])
        # every shard, from worker 0, so servers end complete too
        self._write(broadcast(np.empty(self.count, self.dtype), root=0, comm=self.comm))
        return self._gather_stats({"role": "server", "rank": self.rank, "updates": version,
                                   "staleness": dict(histogram),
                                   "seconds": time.perf_counter() - started})

    def _gather_stats(self, mine: dict[str, Any]) -> dict[str, Any]:
        everyone = self.comm.allgather_object(mine)
        histogram: Counter = Counter()
        for entry in everyone:
            histogram.update(entry.get("staleness", {}))
        self.stats = {"mode": self.mode, "servers": self.servers, "workers": self.workers,
                      "staleness_bound": self.staleness,
                      "updates": [e["updates"] for e in everyone if e["role"] == "server"],
                      "worker_steps": [e["steps"] for e in everyone if e["role"] == "worker"],
                      "staleness": dict(sorted(histogram.items()))}
        return self.stats


def format_histogram(histogram: dict[int, int]) -> str:
    """'staleness 0: 120 (75.0%), 1: 40 (25.0%)' for a {staleness: count} histogram."""
    total = sum(histogram.values()) or 1
    return "staleness " + ", ".join(f"{k}: {v} ({100 * v / total:.1f}%)"
                                    for k, v in sorted(histogram.items()))
