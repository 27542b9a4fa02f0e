"""How ZeRO (`mpdl.parallel.zero`) holds each unit's parameters: whole on every rank (stages 1 and 2,
`ReplicatedParameters`), or as this rank's shard only, gathered around each use (stage 3,
`ShardedParameters`). The strategy picks one at setup; both answer the same calls at the same
points of a step, so the step reads the same for every stage.

Stage 3 (FSDP's FULL_SHARD). Units are the modules inside containers (`module_units`: the blocks
of a ModuleList, the layers of a Sequential), split into their children while larger than
1/UNITS_PER_MODEL of the model; what is left (the root's own parameters, embeddings used again by
the root) is the *root unit*, gathered for the whole step. A unit's forward is wrapped: its
parameters are all-gathered just before it and freed after (its `p.data` becomes a zero-byte
placeholder of the right shape); an identity node on its output gathers them again just before
its backward; once its gradients are all in, the parameters are freed. With `prefetch`, the next
unit's all-gather (the previous one's in backward) is started at once, so it overlaps this unit's
compute.

What the autograd graph keeps: mpdl's primitives save their input arrays for backward, so the
gathered weights a unit's forward used would stay alive in the graph until its backward; stage 3
takes those references out of the unit's nodes when it frees the unit after forward and puts the
gathered arrays back before its backward. A unit run again inside a recomputed block
(`mpdl.autograd.checkpoint`) is gathered without prefetch and kept until its gradients are in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from mpdl import memory
from mpdl.autograd import nn
from mpdl.autograd.recompute import recomputing
from mpdl.autograd.tensor import Function, Tensor, is_grad_enabled
from mpdl.collectives import allgather
from mpdl.comm import Communicator
from mpdl.comm.handles import Handle
from mpdl.parallel import flat
from mpdl.parallel.shards import Unit, placeholder
from mpdl.parallel.zero_meter import ZeroMeter
from mpdl.tuning import allgather_init

#: stage 3 by default: a unit holds at most 1/UNITS_PER_MODEL of the model (a module larger than
#: that is split into its children)
UNITS_PER_MODEL = 16

#: runs a piece of communication on the communication thread and returns its handle
Submit = Callable[[Callable[[], Any]], Handle]


class UnitParameters:
    """The units' parameters as a ZeRO stage holds them, and what it does with them at each point
    of a step (here: nothing; the stages below say otherwise). Collectives run over `comm` (the
    shard group) with `algorithm`, on the communication thread through `submit`; `meter` counts
    the bytes held and times the waits."""

    #: whether a unit's forward gathers its parameters (a collective: then a rank without samples
    #: must still run a forward)
    gathers_in_forward = False

    def __init__(self, units: list[Unit], comm: Communicator, algorithm: str, submit: Submit,
                 meter: ZeroMeter) -> None:
        self.units, self.comm, self.algorithm = units, comm, algorithm
        self.submit, self.meter = submit, meter

    def place(self, unit: Unit) -> None:
        """Set up the unit's parameter storage (its parameters become views or placeholders)."""
        raise NotImplementedError

    def plan(self, unit: Unit) -> None:
        """Make the persistent plans of the unit's parameter collectives (none)."""

    def reduce_order(self) -> list[Unit]:
        """The order in which the units' gradients are reduce-scattered: unit order."""
        return list(self.units)

    def before_forward(self) -> None:
        """A step begins."""

    def gradients_done(self, unit: Unit) -> None:
        """Backward has produced all of the unit's gradients."""

    def after_backward(self) -> None:
        """Every gradient is reduce-scattered."""

    def after_optimizer_step(self) -> None:
        """The optimizer has updated the shards."""

    def whole(self) -> AbstractContextManager[None]:
        """Within the block every rank holds the whole model (values written into it are kept)."""
        return nullcontext()


class ReplicatedParameters(UnitParameters):
    """Stages 1 and 2: every rank holds the whole parameters, each unit's in one flat buffer
    (`unit.full`, its parameters and its shard are views of it); after the optimizer step, each
    unit's buffer is all-gathered in place through a persistent plan."""

    def place(self, unit: Unit) -> None:
        whole = flat.pack([p.data for p in unit.params])
        unit.full, unit.shard = whole, whole[unit.lo:unit.hi]
        memory.hold(whole, "parameters")
        for p, view in zip(unit.params, unit.views(whole), strict=True):
            p.data = view
        self.meter.hold(unit.nbytes)

    def plan(self, unit: Unit) -> None:
        unit.gather_plan = allgather_init(unit.shard, algorithm=self.algorithm, comm=self.comm,
                                          count=unit.count, out=unit.full)

    def after_optimizer_step(self) -> None:
        """All-gather every unit's updated shard into its flat buffer, and wait."""
        handles = [self.submit(self._gather_in_place(u)) for u in self.units]
        with self.meter.waiting():
            for h in handles:
                h.wait()

    def _gather_in_place(self, unit: Unit) -> Callable[[], None]:
        def work() -> None:
            with self.meter.communicating(unit, "all-gather"):
                unit.gather_plan()
        return work


class ShardedParameters(UnitParameters):
    """Stage 3: each unit held as this rank's shard only, all-gathered just before the unit's
    forward and again before its backward, freed after each (see the module docstring)."""

    gathers_in_forward = True

    def __init__(self, units: list[Unit], comm: Communicator, algorithm: str, submit: Submit,
                 meter: ZeroMeter, prefetch: bool = True) -> None:
        super().__init__(units, comm, algorithm, submit, meter)
        self.prefetch = prefetch
        #: False inside `whole()`: every unit is held and the forwards run as they are
        self.sharded = True
        self._gathering: dict[int, Handle] = {}  # unit index: its all-gather on its way
        #: unit index: (graph node, attribute, parameter index) of the references to the gathered
        #: parameters taken out of the graph after forward, put back before backward
        self._saved: dict[int, list[tuple[Any, str, int]]] = {}

    def place(self, unit: Unit) -> None:
        whole = flat.pack([p.data for p in unit.params])
        unit.shard = whole[unit.lo:unit.hi].copy()
        memory.hold(unit.shard, "parameters")
        for p in unit.params:
            p.data = placeholder(p)
        self.meter.hold(unit.shard_nbytes)
        if unit.module is not None:
            self._wrap(unit)

    def reduce_order(self) -> list[Unit]:
        """The blocks as backward finishes them, the root unit (whose embedding gradient is
        complete only when backward ends) last, so that it holds no block's gradient buffer
        back."""
        return ([u for u in reversed(self.units) if u.module is not None]
                + [u for u in self.units if u.module is None])

    def before_forward(self) -> None:
        """Gather the root unit, held for the whole step."""
        for u in self.units:
            if u.module is None:
                self.wait(u)

    def gradients_done(self, unit: Unit) -> None:
        self.free(unit)

    def after_backward(self) -> None:
        """Free every unit, the root unit too."""
        for u in self.units:
            self.free(u, root=True)

    @contextmanager
    def whole(self) -> Iterator[None]:
        for u in self.units:
            self.wait(u)
        self.sharded = False
        try:
            yield
        finally:
            self.sharded = True
            for u in self.units:
                u.xp.copyto(u.shard, u.full[u.lo:u.hi])
                self.free(u, root=True)

    # -- gather and free ---------------------------------------------------------------------------
    def gather(self, unit: Unit) -> None:
        """Start the all-gather of unit's parameters (nothing if held or on its way)."""
        if unit.full is not None or unit.index in self._gathering:
            return
        full = unit.xp.empty(unit.count, dtype=unit.dtype)
        memory.hold(full, "parameters")
        self.meter.hold(unit.nbytes)

        def work() -> Any:
            with self.meter.communicating(unit, "all-gather"):
                allgather(unit.shard, algorithm=self.algorithm, comm=self.comm, count=unit.count,
                          out=full)
            return full

        self._gathering[unit.index] = self.submit(work)

    def wait(self, unit: Unit) -> None:
        """Wait until unit's parameters are here and point them at the gathered buffer."""
        if unit.full is None:
            self.gather(unit)
            with self.meter.waiting(gather=unit):
                unit.full = self._gathering[unit.index].wait()
            del self._gathering[unit.index]
            for p, view in zip(unit.params, unit.views(unit.full), strict=True):
                p.data = view

    def free(self, unit: Unit, root: bool = False) -> None:
        """Drop unit's gathered parameters (the root unit's only with `root`: it is kept for
        the whole step)."""
        if unit.full is None or unit.module is None and not root:
            return
        unit.full = None
        for p in unit.params:
            p.data = placeholder(p)
        self.meter.release(unit.nbytes)

    def _wrap(self, unit: Unit) -> None:
        original = unit.module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.sharded:
                return original(*args, **kwargs)
            if recomputing():  # in backward: gathered until its gradients are in, no prefetch
                self.wait(unit)
                return original(*args, **kwargs)
            self.wait(unit)
            if self.prefetch and unit.index + 1 < len(self.units):
                self.gather(self.units[unit.index + 1])
            out = original(*args, **kwargs)
            if isinstance(out, Tensor) and out.requires_grad and is_grad_enabled():
                self._saved[unit.index] = _unhook_parameters(unit, out, args)
                out = _BeforeBackward.apply(out, hook=lambda: self._before_backward(unit))
            self.free(unit)
            return out

        unit.module.forward = forward

    def _before_backward(self, unit: Unit) -> None:
        self.wait(unit)
        for ctx, name, i in self._saved.pop(unit.index, []):  # the graph's references
            setattr(ctx, name, unit.params[i].data)
        if self.prefetch and unit.index > 0:
            self.gather(self.units[unit.index - 1])


class _BeforeBackward(Function):
    """Identity whose backward first calls `hook` (stage 3: gather the unit's parameters)."""

    def forward(self, x, hook):
        self.hook = hook
        return x.view()

    def backward(self, grad):
        self.hook()
        return grad


def _unhook_parameters(unit: Unit, out: Tensor, inputs: Sequence[Any]) -> list[tuple]:
    """Take the graph's references to unit's gathered parameter arrays (what its forward's
    nodes saved for backward: a linear layer's weight) out of the nodes between `out` and the
    unit's `inputs`, so that freeing the parameters frees their memory until backward gathers
    them again; returns (node, attribute, parameter index) to put them back."""
    arrays = {id(p.data): i for i, p in enumerate(unit.params)}
    stop = {id(t) for t in inputs if isinstance(t, Tensor)}
    taken, seen, stack = [], set(), [out]
    while stack:
        ctx = stack.pop()._ctx
        if ctx is None or id(ctx) in seen or isinstance(ctx, _BeforeBackward):
            continue
        seen.add(id(ctx))
        for name, value in list(vars(ctx).items()):
            i = arrays.get(id(value))
            if i is not None:
                taken.append((ctx, name, i))
                setattr(ctx, name, None)
        stack.extend(t for t in ctx.inputs or () if id(t) not in stop)
    return taken


def module_units(model: Any, names: Sequence[str] | None = None) -> list[tuple[Any, list[Any]]]:
    """(module, its parameters) of stage 3's units in forward order: the submodules `names` (of
    model.named_modules()), or by default the modules held in a ModuleList or Sequential
    (searched from the root down, not inside a unit), each one holding more than 1/UNITS_PER_MODEL
    of the model's parameters replaced by its children (again while too large; FSDP wraps
    transformer blocks, DeepSpeed fetches by submodule); then (None, the rest): the root unit. A
    parameter registered in two units, or registered on a module that was split, goes to the root
    unit."""
    found: list[Any] = []

    def visit(module: Any) -> None:
        for child in module.children():
            if isinstance(module, (nn.ModuleList, nn.Sequential)):
                found.append(child)
            else:
                visit(child)

    def size(module: Any) -> int:
        return sum(p.size for p in module.parameters() if p.requires_grad)

    cap = size(model) / UNITS_PER_MODEL

    def split(module: Any) -> list[Any]:
        children = [c for c in module.children() if size(c)]
        if size(module) > cap and children:
            return [unit for c in children for unit in split(c)]
        return [module]

    if names is None:
        visit(model)
        found = [unit for m in found for unit in split(m)]
    else:
        modules = dict(model.named_modules())
        unknown = [n for n in names if n not in modules or not n]
        if unknown:
            raise ValueError(f"units: no submodule named {unknown[0]!r}; the model has "
                             f"{', '.join(n for n in modules if n)}")
        found = [modules[n] for n in names]
    owners: dict[int, int] = {}
    for i, m in enumerate(found):
        for p in m.parameters():
            owners[id(p)] = -1 if owners.get(id(p), i) != i else i
    units = [(m, [p for p in m.parameters() if p.requires_grad and owners[id(p)] == i])
             for i, m in enumerate(found)]
    rest = [p for p in model.parameters() if p.requires_grad and owners.get(id(p), -1) == -1]
    return [(m, ps) for m, ps in units if ps] + ([(None, rest)] if rest else [])
