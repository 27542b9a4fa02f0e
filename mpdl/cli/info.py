"""`mpdl info`: what this rank runs on (versions, MPI, nodes, GPU, CUDA-awareness).

With --json, rank 0 prints one merged JSON object: the fields common to all ranks plus a `ranks`
list with each rank's host, node, local rank and GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy

import mpdl
from mpdl import backend, blas
from mpdl.comm import as_communicator, cuda_aware_mpi, polling, ranks_per_node_override
from mpdl.mpi_runtime import library_version, load_mpi, usable_cores
from mpdl.tuning import auto


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one merged JSON object on rank 0 instead of the table")


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def collect() -> dict[str, Any]:
    """The facts `mpdl info` reports, as seen from this rank (MPI is initialised here)."""
    MPI = load_mpi()
    comm = as_communicator(None)
    nodes = comm.node_groups()
    node = comm.node_of_rank()[comm.rank]
    thread_levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                     MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    cupy = backend.cupy_module()
    aware, how = cuda_aware_mpi()
    return {
        "mpdl": mpdl.__version__,
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "numba": _version("numba"),
        "blas": blas.describe(),
        "mpi4py": _version("mpi4py"),
        "mpi_library": library_version(MPI),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "thread_level": thread_levels.get(MPI.Query_thread(), "unknown"),
        "world_size": comm.size,
        "nodes": len(nodes),
        "ranks_per_node": [len(g) for g in nodes],
        "nodes_emulated": ranks_per_node_override() is not None,
        "cupy": None if cupy is None else cupy.__version__,
        "gpus": 0 if cupy is None else cupy.cuda.runtime.getDeviceCount(),
        "cuda_aware_mpi": aware,
        "cuda_aware_mpi_how": how,
        "gpu_buffers": "direct to MPI" if aware == "yes" else "staged through host buffers",
        "cores": usable_cores(),
        "waiting_ranks_yield": ("at every poll (more ranks on a node than cores)"
                                if comm.yield_every == 1 else f"every {comm.yield_every} polls"),
        "plans_wait": ("in compiled code (MPI_Testall in a numba loop, from a plan's 8th run)"
                       if polling.load() else "from Python (no numba or no libmpi found)"),
        **_cost_model(comm),
        "rank": comm.rank,
        "host": socket.gethostname(),
        "node": node,
        "local_rank": nodes[node].index(comm.rank),
    }


def _cost_model(comm) -> dict[str, Any]:
    """Which cost model `auto` chooses with on this communicator, looked up without measuring
    (rank 0's answer is the one every rank uses)."""
    model, path = auto.look(comm)
    if model is None:
        return {"cost_model": f"not calibrated yet: the first auto call measures it (about a "
                              f"second) and saves {path}",
                "cost_model_calibrated": False}
    return {"cost_model": model.describe(), "cost_model_calibrated": model.calibrated,
            "cost_model_provisional": model.provisional}


_PER_RANK = ("rank", "host", "node", "local_rank")


def run(args: argparse.Namespace) -> int:
    mine = collect()
    everyone = as_communicator(None).allgather_object(mine)
    if mine["rank"] != 0:
        return 0
    merged = {k: v for k, v in mine.items() if k not in _PER_RANK}
    merged["ranks"] = [{k: r[k] for k in _PER_RANK} for r in everyone]
    if args.json:
        print(json.dumps(merged))
        return 0
    width = max(len(k) for k in merged)
    for key, value in merged.items():
        if key == "ranks":
            continue
        if isinstance(value, list):
            value = ", ".join(map(str, value))
        print(f"{key:<{width}}  {value}")
    for r in merged["ranks"]:
        print(f"{'rank ' + str(r['rank']):<{width}}  host {r['host']}, node {r['node']}, "
              f"local rank {r['local_rank']}")
    return 0
