"""The MPI library's own algorithms, chosen by name through its control variables (MPI_T), for
`mpdl bench --mpi-variants`.

MPICH reads `MPIR_CVAR_<COLL>_INTRA_ALGORITHM` at every collective call, so a write through the
MPI tool interface (MPI_T_cvar_write) switches the algorithm of the next call; with
`MPIR_CVAR_COLLECTIVE_FALLBACK=error` a forced algorithm that does not apply to the arguments
raises instead of quietly running another. Open MPI's tuned component reads
`coll_tuned_use_dynamic_rules` and `coll_tuned_<coll>_algorithm` when a communicator is created,
so each variant runs on a duplicate of the communicator made after the write. mpi4py has no
MPI_T: the calls go through ctypes to the library mpi4py loaded.

Each variant is named `mpi:NAME`, NAME being mpdl's algorithm of the same method where there is
one (`LIBRARY_NAMES`), the library's own name otherwise (prefixed by the library's where that name
is taken: MPICH's k-ary `tree` broadcast beside its `pipelined_tree`, which is mpdl's `tree`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: (library, mpdl collective) -> {the library's algorithm name: mpdl's name of the same method}
LIBRARY_NAMES: dict[tuple[str, str], dict[str, str]] = {
    ("mpich", "allreduce"): {"recursive_doubling": "recursive_doubling", "ring": "ring",
                             "reduce_scatter_allgather": "rabenseifner", "tree": "tree"},
    ("mpich", "allgather"): {"brucks": "bruck", "recursive_doubling": "recursive_doubling",
                             "ring": "ring"},
    ("mpich", "reduce_scatter"): {"pairwise": "pairwise",
                                  "recursive_halving": "recursive_halving"},
    ("mpich", "broadcast"): {"binomial": "binomial", "pipelined_tree": "tree",
                             "scatter_ring_allgather": "scatter_allgather"},
    ("mpich", "reduce"): {"binomial": "binomial",
                          "reduce_scatter_gather": "reduce_scatter_gather"},
    ("mpich", "alltoall"): {"brucks": "bruck", "pairwise": "pairwise", "scattered": "scattered"},
    ("openmpi", "allreduce"): {"recursive_doubling": "recursive_doubling", "ring": "ring",
                               "rabenseifner": "rabenseifner"},
    ("openmpi", "allgather"): {"bruck": "bruck", "recursive_doubling": "recursive_doubling",
                               "ring": "ring"},
    ("openmpi", "reduce_scatter"): {"recursive_halving": "recursive_halving", "ring": "ring"},
    ("openmpi", "broadcast"): {"binomial": "binomial", "scatter_allgather_ring":
                               "scatter_allgather", "pipeline": "ring"},
    ("openmpi", "reduce"): {"binomial": "binomial", "rabenseifner": "reduce_scatter_gather"},
    ("openmpi", "alltoall"): {"modified_bruck": "bruck", "pairwise": "pairwise"},
}
#: the library's choices that are not one algorithm, or that need what a bench run lacks
#: (MPICH's smp raised on some ranks only, which would leave the others waiting)
SKIPPED = {"auto", "ignore", "nb", "smp", "ccl"}
_MPICH_NAMES = {"allreduce": "ALLREDUCE", "allgather": "ALLGATHER",
                "reduce_scatter": "REDUCE_SCATTER", "broadcast": "BCAST", "reduce": "REDUCE",
                "alltoall": "ALLTOALL"}
_OPENMPI_NAMES = {"allreduce": "allreduce", "allgather": "allgather",
                  "reduce_scatter": "reduce_scatter", "broadcast": "bcast", "reduce": "reduce",
                  "alltoall": "alltoall"}


class Unavailable(RuntimeError):
    """The library offers no algorithm control this module knows (one line saying why)."""


class _Tool:
    """The MPI tool interface's control variables, through ctypes."""

    def __init__(self, MPI: Any):
        self.lib = ctypes.CDLL(MPI.__file__)  # its symbols resolve in the library mpi4py loaded
        self.int_type = MPI._handleof(MPI.INT)
        provided = ctypes.c_int()
        if self.lib.MPI_T_init_thread(0, ctypes.byref(provided)) != 0:
            raise Unavailable("MPI_T_init_thread failed")

    def variable(self, name: str) -> tuple[Any, list[tuple[str, int]]]:
        """(a handle to write the integer variable `name`, its named values)."""
        index = ctypes.c_int()
        if self.lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) != 0:
            raise Unavailable(f"the MPI library has no control variable {name}")
        text, length = ctypes.create_string_buffer(256), ctypes.c_int(256)
        desc, desc_len = ctypes.create_string_buffer(8192), ctypes.c_int(8192)
        verbosity, datatype, bind, scope = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), \
            ctypes.c_int()
        enum = ctypes.c_void_p()
        self.lib.MPI_T_cvar_get_info(index, text, ctypes.byref(length), ctypes.byref(verbosity),
                                     ctypes.byref(datatype), ctypes.byref(enum), desc,
                                     ctypes.byref(desc_len), ctypes.byref(bind),
                                     ctypes.byref(scope))
        handle, count = ctypes.c_void_p(), ctypes.c_int()
        if self.lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle),
                                            ctypes.byref(count)) != 0:
            raise Unavailable(f"cannot write the control variable {name}")
        values = self._enum(enum) if enum.value else _described(desc.value.decode())
        return handle, values

    def _enum(self, enum: Any) -> list[tuple[str, int]]:
        count, name, length = ctypes.c_int(), ctypes.create_string_buffer(256), ctypes.c_int(256)
        self.lib.MPI_T_enum_get_info(enum, ctypes.byref(count), name, ctypes.byref(length))
        items = []
        for k in range(count.value):
            value, item, size = ctypes.c_int(), ctypes.create_string_buffer(256), ctypes.c_int(256)
            self.lib.MPI_T_enum_get_item(enum, k, ctypes.byref(value), item, ctypes.byref(size))
            items.append((item.value.decode(), value.value))
        return items

    def read(self, handle: Any) -> int:
        value = ctypes.c_int()
        self.lib.MPI_T_cvar_read(handle, ctypes.byref(value))
        return value.value

    def write(self, handle: Any, value: int) -> None:
        if self.lib.MPI_T_cvar_write(handle, ctypes.byref(ctypes.c_int(value))) != 0:
            raise Unavailable("MPI_T_cvar_write failed")


def _described(description: str) -> list[tuple[str, int]]:
    """MPICH's enumerated values, listed one a line as `name - what` after the first line of the
    variable's description, numbered in that order (the order of its C enumeration)."""
    names = [line.split(" - ")[0].strip() for line in description.splitlines()[1:]
             if " - " in line]
    return [(n, i) for i, n in enumerate(names) if n and " " not in n]


def library(MPI: Any) -> str:
    """"mpich" or "openmpi" from the library's version string; Unavailable otherwise."""
    version = MPI.Get_library_version()
    if "MPICH" in version:
        return "mpich"
    if "Open MPI" in version:
        return "openmpi"
    raise Unavailable(f"--mpi-variants knows MPICH and Open MPI, not {version.split()[0]}")


def _label(library_name: str, item: str, known: dict[str, str]) -> str:
    """`mpi:NAME` of the library's algorithm `item` (see the module's docstring)."""
    if item in known:
        return f"mpi:{known[item]}"
    return f"mpi:{library_name}_{item}" if item in known.values() else f"mpi:{item}"


@dataclass
class Variant:
    """One of the library's algorithms: `enter()` before its calls, `leave()` after (outside
    the clock), `comm` the communicator to call it on."""

    name: str
    library_name: str
    counterpart: str | None
    comm: Any
    enter: Callable[[], None]
    leave: Callable[[], None]


def variants(comm: Any, collective: str) -> list[Variant]:
    """The library's algorithms of `collective` on comm (an MPIComm; collective for Open MPI,
    which duplicates the communicator once per variant). Unavailable says why there are none."""
    from mpdl.comm import as_communicator  # noqa: PLC0415 (perf sits above comm; lazily: MPI)

    MPI = comm.MPI
    name = library(MPI)
    tool = _Tool(MPI)
    known = LIBRARY_NAMES[(name, collective)]
    found = []
    if name == "mpich":
        handle, values = tool.variable(f"MPIR_CVAR_{_MPICH_NAMES[collective]}_INTRA_ALGORITHM")
        fallback, modes = tool.variable("MPIR_CVAR_COLLECTIVE_FALLBACK")
        error, usual, automatic = dict(modes)["error"], tool.read(fallback), tool.read(handle)
        for item, value in values:
            if item in SKIPPED:
                continue

            def enter(value=value) -> None:
                tool.write(fallback, error)
                tool.write(handle, value)

            def leave() -> None:
                tool.write(handle, automatic)
                tool.write(fallback, usual)

            found.append(Variant(_label(name, item, known), item, known.get(item), comm, enter,
                                 leave))
        return found
    rules, _ = tool.variable("coll_tuned_use_dynamic_rules")
    handle, values = tool.variable(f"coll_tuned_{_OPENMPI_NAMES[collective]}_algorithm")
    for item, value in values:
        if item in SKIPPED or value == 0:
            continue
        tool.write(rules, 1)
        tool.write(handle, value)
        duplicate = as_communicator(comm.mpi.Dup())
        tool.write(handle, 0)
        tool.write(rules, 0)
        found.append(Variant(_label(name, item, known), item, known.get(item), duplicate,
                             lambda: None, lambda: None))
    return found
