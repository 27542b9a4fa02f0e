"""`auto`: which registered algorithm a collective call runs when the caller does not say.

The choice is the algorithm the cost model (`mpdl.tuning.costmodel`) predicts fastest for the
call's size, world size, node count and shared memory, plus the settings' emulated links. The
model's parameters (`model_for(comm)`), in this order:

1. `MPDL_COST_MODEL=off`: no model, a size rule decides (`simple_choice`); `=defaults`: the
   default parameters;
2. the calibration file `mpdl calibrate` saved (MPDL_COST_MODEL, ~/.cache/mpdl/costmodel.json),
   its entry for the nearest world size; a broken file means no model (the size rule);
3. otherwise the first-use calibration of this machine and world shape (`mpdl.tuning.firstuse`):
   read from the settings' `auto_cache` folder (MPDL_AUTO_CACHE), or measured now by every rank of
   the communicator (at most `firstuse.SECONDS`) and saved there, once: a calibration taken on a
   busy machine is kept, marked provisional with the load it saw, and never taken again at
   start-up (the plans' verification refines the choices that matter online; `mpdl calibrate`
   measures anew). A part of the world (a sub-communicator) derives its model from the world's
   calibration where there is one (the cost model predicts its shape from the world's links),
   and measures itself, once, only where there is none. A cache file that cannot be read is
   ignored with a warning and measured again;
4. the defaults where there is nothing to measure (`MPDL_AUTO_CACHE=off`, one rank, the in-process
   world).

Every rank must run the same algorithm, or the call deadlocks. So on a communicator's first `auto`
call its rank 0 looks at the files and tells the others what it found (one small all-gather); when
it found nothing every rank measures, and rank 0 writes the file. The model is then kept on the
communicator, and each choice in one cache (a dictionary lookup per call). Another look happens
after `forget()` (call it on every rank, as `mpdl calibrate` does) or a change of the settings'
`cost_model` / `auto_cache`; link emulation changes only the choices.

A model also holds the choices that plans verified online (`mpdl.tuning.verify`), read from
and written to the first-use cache: a plan of such a size runs the verified algorithm
(`plan_choice`); one-shot calls keep the prediction. A choice verified on a busy machine is
provisional: used, and verified again by the next run's first plan of its size.

`choose(collective, nbytes, p, nodes, shared_memory)` without a model is the pure function of the
calibration file (or the defaults) that needs no communicator.
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings
from dataclasses import dataclass, field

from mpdl import settings
from mpdl.collectives import registry
from mpdl.collectives.hook import simple_choice
from mpdl.comm.handles import run_in_order
from mpdl.tuning import costmodel, firstuse

_serial = itertools.count()


@dataclass(frozen=True)
class Model:
    """The parameters `auto` chooses with, and where they come from.

    origin: "off" (no model: the size rule), "defaults", "file" (`mpdl calibrate`'s), "cache" (a
    first-use calibration read back), "measured" (a first-use calibration made in this run) or
    "derived" (a part of the world's, from the world's first-use calibration, noted in `path`);
    `path` is the file read or written, `note` says why when it matters; `verified` holds the
    choices plans verified online ("collective:bytes" -> algorithm), `unsettled` why those
    verified on a busy machine are provisional, and `recheck` those of them (read from the cache)
    that a plan of this run verifies again."""

    params: costmodel.Params | None
    origin: str
    path: str = ""
    note: str = ""
    verified: dict = field(default_factory=dict, compare=False, hash=False)
    unsettled: dict = field(default_factory=dict, compare=False, hash=False)
    recheck: set = field(default_factory=set, compare=False, hash=False)
    #: tells models apart in the choice cache
    serial: int = field(init=False, default_factory=lambda: next(_serial), compare=False)

    @property
    def calibrated(self) -> bool:
        return self.origin in ("file", "cache", "measured", "derived")

    @property
    def provisional(self) -> str:
        """Why the calibration is provisional (taken on a busy machine); "" when it is not."""
        return self.params.provisional if self.params is not None and self.calibrated else ""

    def describe(self) -> str:
        """One line for `mpdl info` and `mpdl bench`."""
        text = {"off": "off: a size rule picks the algorithm",
                "defaults": "defaults (not calibrated)",
                "file": f"calibrated by `mpdl calibrate`: {self.path}",
                "cache": f"calibrated on first use: {self.path}",
                "measured": f"calibrated on first use, now: saved to {self.path}",
                "derived": f"derived from the world's first-use calibration: saved to "
                           f"{self.path}"}[self.origin]
        if self.params is not None and self.calibrated:
            text += f" ({self.params.source})"
        if self.provisional:
            text = f"provisional ({self.provisional}): {text}"
        if self.unsettled:
            text += (f"; {len(self.unsettled)} of {len(self.verified)} verified choices "
                     f"provisional ({next(iter(self.unsettled.values()))})")
        return f"{text}; {self.note}" if self.note else text


# -- where the model comes from ----------------------------------------------------------------
def _calibration_file(p: int) -> Model | None:
    """The model of the settings' cost_model (off, defaults, or the calibration file when it has
    entries); None when there is no calibration file."""
    configured = settings.current().cost_model
    if configured == "off":
        return Model(None, "off", note=f"{costmodel.ENV}=off")
    if configured == "defaults":
        return Model(costmodel.Params(), "defaults", note=f"{costmodel.ENV}=defaults")
    path = costmodel.default_path()
    try:
        if not costmodel.read_file(path):
            return None
        return Model(costmodel.load_params(p), "file", path)
    except costmodel.ModelUnavailable as exc:
        return Model(None, "off", path, note=str(exc))


_static: dict = {}


def static_model(p: int) -> Model:
    """The model of the calibration file or the defaults, with no first-use calibration (what a
    call without a communicator gets)."""
    key = (settings.current().cost_model, p, costmodel.generation())
    model = _static.get(key)
    if model is None:
        model = _calibration_file(p) or Model(costmodel.Params(), "defaults",
                                               note="no calibration file")
        if len(_static) > 64:
            _static.clear()
        _static[key] = model
    return model


_defaults: dict[str, Model] = {}


def _default_model(note: str) -> Model:
    """The defaults, one Model per reason (so that their choices are remembered across comms)."""
    if note not in _defaults:
        _defaults[note] = Model(costmodel.Params(), "defaults", note=note)
    return _defaults[note]


def _measurable(comm) -> bool:
    """A communicator over real MPI processes (not the in-process world) of two ranks or more."""
    root = firstuse.root_of(comm)
    return comm.size > 1 and getattr(root, "mpi", None) is not None


def look(comm) -> tuple[Model | None, str]:
    """What this rank finds without measuring: (the model, ""), or (None, the cache file to
    measure into). A calibration in the cache is the model, provisional or not; a part of the
    world with none of its own derives one from the world's (origin "derived", to be saved in its
    own file). No communication."""
    static = static_model(comm.size)
    if static.origin != "defaults" or static.note != "no calibration file":
        return static, ""
    folder = settings.current().auto_cache
    if folder == "off":
        return _default_model("no calibration file, first-use calibration off "
                              "(MPDL_AUTO_CACHE=off)"), ""
    if not _measurable(comm):
        return _default_model("nothing to measure on one rank or the in-process world"), ""
    key = firstuse.cache_key(comm)
    path = firstuse.cache_path(folder, key)
    try:
        params = firstuse.read(path, key)
    except costmodel.ModelUnavailable as exc:
        warnings.warn(f"mpdl auto: ignoring {exc}; measuring again", RuntimeWarning, stacklevel=2)
        return None, path
    if params is None:
        world = firstuse.root_of(comm)
        if world is comm:
            return None, path
        world_key = firstuse.cache_key(world)
        try:
            params = firstuse.read(firstuse.cache_path(folder, world_key), world_key)
        except costmodel.ModelUnavailable:
            params = None  # the world's own first use warns of it
        if params is None:
            return None, path
        return Model(firstuse.derived(params), "derived", path), ""
    unsettled = firstuse.read_unsettled(path, key)
    return Model(params, "cache", path, verified=firstuse.read_verified(path, key),
                 unsettled=unsettled, recheck=set(unsettled)), ""


def _agree(comm) -> Model:
    """Collective over comm: rank 0's model, measured by every rank when rank 0 has none."""
    if not _measurable(comm):
        return look(comm)[0]
    # the node layouts the cache key names: collective the first time, so every rank asks
    comm.node_groups()
    firstuse.root_of(comm).node_groups()
    mine = look(comm) if comm.rank == 0 else None
    found, path = comm.allgather_object(mine)[0]
    if found is not None:  # a model of this process (its serial keys its cache)
        note = ""
        if found.origin == "derived":
            note = _saved_by_rank_0(found.path, comm, found.params)
        return Model(found.params, found.origin, found.path, found.note or note,
                     dict(found.verified), dict(found.unsettled), set(found.recheck))
    if comm.rank == 0:  # the user never waits silently
        print(f"mpdl: first use, calibrating: the collectives for `auto` on {comm.size} ranks (at "
              f"most about {firstuse.SECONDS:g} s, once for this machine and rank count), cached "
              f"in {path}; to skip: MPDL_AUTO_CACHE=off, or `mpdl calibrate` once",
              file=sys.stderr, flush=True)
    params = firstuse.measure_quick(comm)
    return Model(params, "measured", path, _saved_by_rank_0(path, comm, params))


def _saved_by_rank_0(path: str, comm, params: costmodel.Params) -> str:
    """Collective over comm: rank 0 writes the file, and every rank returns once it is there (a
    part of comm whose rank 0 is another rank reads it next); "" or why it could not."""
    return comm.allgather_object(_save(path, comm, params) if comm.rank == 0 else None)[0]


def _save(path: str, comm, params: costmodel.Params) -> str:
    """Write comm's first-use calibration to path; "" or, when it could not, why (warned)."""
    try:
        firstuse.write(path, firstuse.cache_key(comm), params)
    except OSError as exc:
        note = f"could not save it ({exc}); set MPDL_AUTO_CACHE to a writable folder"
        warnings.warn(f"mpdl auto: first-use calibration {note}", RuntimeWarning, stacklevel=3)
        return note
    return ""


def model_for(comm) -> Model:
    """The model `auto` chooses with on comm (an mpdl Communicator). Collective the first time on
    each communicator (every rank of comm calls it at the same point: its first `auto` call), and
    again after `forget()` or a change of the settings' cost_model / auto_cache; a lookup after."""
    current = settings.current()
    stamp = (current.cost_model, current.auto_cache, costmodel.generation())
    held = getattr(comm, "_auto_model", None)
    if held is not None and held[0] == stamp:
        return held[1]
    model = run_in_order(comm, lambda: _agree(comm))
    comm._auto_model = (stamp, model)
    return model


# -- the choice --------------------------------------------------------------------------------
def _model_or_rule(model: Model, collective: str, nbytes: int, p: int, nodes: int,
                   shared_memory: bool) -> str:
    if model.params is None:
        return simple_choice(collective, nbytes, p, nodes, shared_memory)
    params = model.params.emulated(settings.current().emulation)
    return costmodel.fastest(collective, nbytes, p, nodes, shared_memory, params)


#: the one cache: [the Settings the choices were made under, {(model, call signature): name}]
_cache: list = [None, {}]


def choose(collective: str, nbytes: int, p: int, nodes: int, shared_memory: bool,
           model: Model | None = None) -> str:
    """The algorithm `auto` runs for a call of nbytes on p ranks over `nodes` nodes, with `model`
    (default: the calibration file's or the defaults, `static_model`). Remembered per model and
    call signature, so a repeated call costs a dictionary lookup."""
    if model is None:
        model = static_model(p)
    current = settings.current()
    if _cache[0] is not current:
        _cache[:] = current, {}
    key = (model.serial, collective, nbytes, p, nodes, shared_memory)
    choices = _cache[1]
    name = choices.get(key)
    if name is None:
        name = choices[key] = _model_or_rule(model, collective, nbytes, p, nodes, shared_memory)
    return name


#: bumped whenever a remembered choice may change (a verdict learned, forget())
_epoch = [0]


def algorithm_for(collective: str, nbytes: int, comm) -> registry.Algorithm:
    """The registered algorithm `auto` runs for a call of nbytes on comm (an mpdl Communicator).
    A repeated call is one lookup in comm's own table of choices, valid while the settings, the loaded
    parameter files and the learned verdicts stay as they were."""
    current = settings.current()
    held = getattr(comm, "_auto_algorithms", None)
    if (held is not None and held[0] is current and held[1] == _epoch[0]
            and held[2] == costmodel.generation()):
        found = held[3].get((collective, nbytes))
        if found is not None:
            return found
    else:
        held = comm._auto_algorithms = (current, _epoch[0], costmodel.generation(), {})
    nodes = len(comm.node_groups()) if comm.size > 1 else 1
    found = registry.resolve(collective, choose(collective, nbytes, comm.size, nodes,
                                                comm.has_shared_memory, model_for(comm)))
    if len(held[3]) > 4096:
        held[3].clear()
    held[3][(collective, nbytes)] = found
    return found


def verified_key(collective: str, nbytes: int, shared: bool = False) -> str:
    """The entry of a plan's verdict in `Model.verified` and the cache file: "collective:bytes",
    with ":shared" for a plan of an array in shared memory (`mpdl.collectives.shm.shared_array`,
    which shm sums where it lies: its own ranking)."""
    return f"{collective}:{nbytes}:shared" if shared else f"{collective}:{nbytes}"


def plan_choice(collective: str, nbytes: int, comm, shared: bool = False) -> registry.Algorithm:
    """The registered algorithm a persistent plan made with `auto` runs for nbytes on comm (of an
    array in shared memory with `shared`): the one such a plan verified (`mpdl.tuning.verify`;
    not under link emulation, which changes the links the verdict was taken on), else
    `algorithm_for`'s. One-shot calls keep the
    prediction: a plan's verdict was taken on runs in the plan's own rhythm, and calls back to
    back rank the algorithms otherwise than calls one at a time
    (docs/results/auto.md#autos-lookup-and-one-shot-calls)."""
    verified = model_for(comm).verified.get(verified_key(collective, nbytes, shared))
    if (verified is not None and not settings.current().emulation
            and verified in costmodel.candidates(collective, comm.has_shared_memory)):
        return registry.resolve(collective, verified)
    return algorithm_for(collective, nbytes, comm)


def ranked(collective: str, nbytes: int, comm, model: Model,
           within: float = math.inf) -> tuple[str, ...]:
    """(auto's choice for nbytes on comm, then every other candidate the model predicts within
    `within` times the choice's time, the fastest predicted first); () when there is no other."""
    nodes = len(comm.node_groups()) if comm.size > 1 else 1
    choice = algorithm_for(collective, nbytes, comm).name
    params = model.params.emulated(settings.current().emulation)
    names = costmodel.candidates(collective, comm.has_shared_memory)

    def predicted(name: str) -> float:
        return costmodel.predict(collective, name, nbytes, comm.size, nodes, params)

    bound = within * predicted(choice)
    others = sorted((predicted(n), i, n) for i, n in enumerate(names) if n != choice)
    field = tuple(n for t, _, n in others if t <= bound)
    return (choice, *field) if field else ()


def learn(comm, collective: str, nbytes: int, algorithm: str, shared: bool = False,
          provisional: str = "") -> None:
    """Keep a plan's verdict: `algorithm` is the fastest for plans of nbytes of collective on comm
    (of arrays in shared memory with `shared`), taken on a busy machine when `provisional` says
    why. Every rank of comm calls it with the same verdict; it holds for the rest of the run, and
    rank 0 writes it into the first-use cache file for the next runs (which verify a provisional
    one again; it never replaces a verdict taken on a quiet machine there)."""
    model = model_for(comm)
    entry = verified_key(collective, nbytes, shared)
    model.verified[entry] = algorithm
    model.recheck.discard(entry)
    model.unsettled.pop(entry, None)
    if provisional:
        model.unsettled[entry] = provisional
    _cache[:] = None, {}
    _epoch[0] += 1
    if comm.rank == 0 and model.origin in ("cache", "measured", "derived"):
        try:
            firstuse.remember(model.path, firstuse.cache_key(comm), entry, algorithm,
                              provisional)
        except OSError as exc:
            warnings.warn(f"mpdl auto: could not note a verified choice in {model.path} ({exc})",
                          RuntimeWarning, stacklevel=2)


def forget() -> None:
    """Look for the model again from now on: drop the remembered choices and the loaded parameter
    files. Call it on every rank of a communicator or on none: the next `auto` call looks again,
    collectively."""
    _cache[:] = None, {}
    _epoch[0] += 1
    _static.clear()
    _defaults.clear()
    costmodel.forget_loaded()

