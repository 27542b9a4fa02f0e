"""The strategy interface: one way to train, behind the one epoch loop of `mpdl.training.loop`.

A strategy decides who holds which parameters and which messages a step sends; the loop does not
know which one it runs. The loop, on every rank of `comm`:

1. builds the strategy (its constructor takes the communicator and its own options) and reads
   `trains`: whether this rank trains on data (a parameter server's servers do not);
2. builds the model and calls `setup(model, make_optimizer)` (collective over comm);
3. on a rank that trains: for every step, `step(batch)`, where the batch is this rank's slice of
   the global batch (`data_comm` says how the data is split: slice `data_comm.rank` of
   `data_comm.size`); at the end `finish()`. On a rank that does not: `serve()`, which returns
   when the ranks that train are done;
4. saves `state_dict()` in a checkpoint and puts it back with `load_state_dict()`, and evaluates,
   inside `gathered()` (collective: a strategy that shards the model gathers it there);
5. reports: `roles()` and `describe()` for the header, `report()` for the JSON rows and summary,
   each step's `StepResult` (time split into compute, communication and its exposed part, and
   timeline spans).

To add a way of training, subclass `Strategy`, implement these, and let the training loop's
`make_strategy` build it from the configuration.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mpdl.autograd import functional as F
from mpdl.autograd.tensor import Tensor
from mpdl.collectives import allreduce
from mpdl.comm import Communicator

#: builds the optimizer of a list of parameters (the loop's choice: sgd, adam, lars, lamb)
MakeOptimizer = Callable[[list[Any]], Any]


@dataclasses.dataclass
class Batch:
    """This rank's slice of a global batch: inputs and labels on the model's device (possibly
    empty), the size of the whole global batch and the learning rate of this step; `count`: the
    targets of the whole global batch (labels >= 0; 0 where not given) and `atoms`: the sizes of
    the atoms this slice is made of (deterministic training; None otherwise)."""

    x: Any
    y: Any
    global_size: int
    lr: float
    count: int = 0
    atoms: list[int] | None = None


@dataclasses.dataclass
class Span:
    """A timed part of a step for the timeline (time.perf_counter seconds); `thread` is "main" or
    "comm", `args` go into the trace event."""

    name: str
    start: float
    end: float
    cat: str = "compute"
    thread: str = "main"
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StepResult:
    """What a step did on this rank: summed loss and correct predictions over its `samples`, and
    seconds of compute, of communication (however long it ran, hidden or not) and of exposed
    communication (what the step waited for it); `grad_norm`: with clipping, the global norm of
    the whole model's gradient before clipping, the same on every rank (None without clipping, or
    on a skipped fp16 step)."""

    loss: float = 0.0
    correct: float = 0.0
    samples: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_s: float = 0.0
    spans: list[Span] = dataclasses.field(default_factory=list)
    grad_norm: float | None = None


class Strategy:
    """One way to train (see the module docstring for the order of the calls)."""

    #: the run's "mode" in the JSON rows, e.g. "allreduce" or "ps"
    mode = "base"
    #: whether every rank writes its part of a checkpoint (`checkpoint_shard`) instead of rank 0
    #: writing the model and `state_dict()`
    sharded_checkpoint = False

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.model: Any = None
        self.optimizer: Any = None

    @property
    def trains(self) -> bool:
        """Whether this rank trains on data (calls `step`), or serves (calls `serve`)."""
        return True

    @property
    def data_comm(self) -> Communicator:
        """The ranks that train: the data is split among them and their metrics are summed."""
        return self.comm

    def roles(self) -> list[tuple[str, int]]:
        """(role, ranks) of the job, the role that trains first, e.g. [("worker", 2),
        ("server", 1)]; [("rank", p)] when every rank does the same; a single role of fewer
        than p members when each spans several ranks ([("replica", dp)] of pp × tp ranks)."""
        return [("rank", self.comm.size)]

    def build(self, make_model: Callable[[], Any]) -> Any:
        """The model this rank holds, from `make_model()` (which builds the whole model): the
        whole of it, unless the strategy holds a part only (a pipeline stage)."""
        return make_model()

    def setup(self, model: Any, make_optimizer: MakeOptimizer) -> None:
        """Take `model` (the same architecture on every rank; rank 0's values win) and build what
        the strategy keeps: its optimizer, buffers, communicators. Collective over comm."""
        raise NotImplementedError

    def step(self, batch: Batch) -> StepResult:
        """Forward, backward, communication and the parameter update of one step."""
        raise NotImplementedError

    def serve(self) -> None:
        """On a rank that does not train: work until the ranks that train have finished."""
        raise RuntimeError(f"{type(self).__name__}: every rank trains; call step()")

    def finish(self) -> bool:
        """End of training on a rank that trains; True when it changed the parameters (the loop
        then evaluates them again)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold besides the model: the optimizer's state_dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def checkpoint_shard(self) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """With `sharded_checkpoint`: (the arrays this rank writes, or None; the manifest of the
        layout, the same on every rank). Collective over comm."""
        raise NotImplementedError

    @contextmanager
    def gathered(self, optimizer_state: bool = False) -> Iterator[None]:
        """Within the block, on every rank that trains, the model holds all its parameters (for
        evaluation and checkpoints) and, with `optimizer_state`, `state_dict()` gives the whole
        optimizer state. Collective over the ranks that train; nothing to do for replicas."""
        yield

    def describe(self, final: bool = False) -> str:
        """The header's words on communication; with `final`, a line for the end of the run
        ('' for none)."""
        raise NotImplementedError

    def report(self, final: bool = False) -> dict[str, Any]:
        """Fields of each JSON row ("algorithm" and "mode" first), or with `final` of the
        summary: what the strategy holds and sends."""
        raise NotImplementedError

    # -- for subclasses ---------------------------------------------------------------------------
    def forward_backward(self, batch: Batch, result: StepResult, weight: float = 1.0,
                         by_count: bool = False) -> float:
        """Forward and backward of the batch (nothing when it is empty), adding loss, correct
        predictions, samples and the forward and backward spans to `result`; returns the time
        backward ended. The gradient is that of `weight` × the mean loss (a microbatch's share
        of the batch), or with `by_count` that of the summed loss over the batch's targets
        divided by `batch.count` (the global batch's targets: then the sum over ranks and
        microbatches is the step's loss whatever their counts), times fp16's loss scale."""
        start = time.perf_counter()
        if not len(batch.y):
            return start
        logits = self.model(Tensor(batch.x))
        scale = getattr(self.optimizer, "loss_scale", 1.0)
        n = len(batch.y)
        if by_count:
            loss = F.cross_entropy(logits, batch.y, reduction="sum")
            forward_end = time.perf_counter()
            loss.backward(scale / batch.count)
            result.loss += float(loss.item()) * batch.global_size / batch.count
        else:
            loss = F.cross_entropy(logits, batch.y)
            forward_end = time.perf_counter()
            seed = weight * scale
            loss.backward(None if seed == 1.0 else seed)
            result.loss += float(loss.item()) * n
        end = time.perf_counter()
        result.correct += correct_predictions(logits.data, batch.y)
        result.samples += n
        result.spans += [Span("forward", start, forward_end), Span("backward", forward_end, end)]
        return end


def grad_norm(optimizer: Any) -> float | None:
    """The optimizer's last global gradient norm before clipping (None without clipping)."""
    return getattr(optimizer, "grad_norm", None)


def counted_once(comm: Communicator, counted: Callable[[Any], bool]
                 ) -> Callable[[list[Any], list[float]], float]:
    """A total for `Optimizer.global_norm`: the sums of squares of the parameters this rank
    counts (`counted(p)`: each distinct element of the model on one rank only, the other copies
    left out), summed over comm (one all-reduce of a number)."""
    def total(params: list[Any], sums: list[float]) -> float:
        mine = math.fsum(s for p, s in zip(params, sums, strict=True) if counted(p))
        return float(allreduce(np.array([mine]), op="sum", comm=comm)[0])

    return total


def microbatches(batch: Batch, n: int) -> list[tuple[Batch, float]]:
    """The batch cut into n contiguous microbatches, each with its share of the batch's samples;
    empty ones (fewer samples than n) come first, so that the last one, whose backward
    communicates, always has samples when the batch has any."""
    if n == 1:
        return [(batch, 1.0)]
    total = len(batch.y)
    sizes = sorted(len(a) for a in np.array_split(np.arange(total), n))
    parts, start = [], 0
    for size in sizes:
        part = Batch(batch.x[start:start + size], batch.y[start:start + size], batch.global_size,
                     batch.lr, count=batch.count)
        parts.append((part, size / total if total else 0.0))
        start += size
    return parts


def correct_predictions(logits: Any, labels: Any) -> float:
    """Right argmax predictions of (N, C) logits; of (N, T, C) sequence logits, N times the
    accuracy over the positions that have a target (label >= 0), so that correct / samples is
    the accuracy either way."""
    hits = logits.argmax(axis=-1) == labels
    if logits.ndim == 2:
        return float(hits.sum())
    counted = labels >= 0
    return float(len(labels) * hits[counted].sum() / max(int(counted.sum()), 1))
