"""Nodes as the MPI library reports them, and the node-aware all-reduces across them.

Under plain `mpiexec -n P` there is one node; under emulated nodes (MPDL_RANKS_PER_NODE) or the
multi-node harness (tools/multinode.sh, real MPI nodes) there are several. The harness names the
layout it launched in MN_EXPECT_NODES ("3,2": 3 ranks on the first node, 2 on the second), and the
node detection must find exactly that.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from mpdl import collectives as C
from mpdl.comm import as_communicator

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()


@pytest.mark.skipif(not os.environ.get("MN_EXPECT_NODES"),
                    reason="the launcher named no node layout (MN_EXPECT_NODES)")
def test_nodes_are_the_launchers_hosts():
    layout = [int(n) for n in os.environ["MN_EXPECT_NODES"].split(",")]
    comm = as_communicator(None)
    groups = comm.node_groups()
    starts = np.cumsum([0, *layout])
    assert groups == [list(range(starts[i], starts[i + 1])) for i in range(len(layout))]
    shared = COMM.Split_type(MPI.COMM_TYPE_SHARED, key=RANK)
    try:
        assert shared.Get_size() == layout[comm.node_of_rank()[RANK]], "MPI's own split disagrees"
    finally:
        shared.Free()


def test_shm_reduces_in_node_windows_and_sends_only_between_nodes():
    comm = as_communicator(None)
    groups = comm.node_groups()
    node = comm.node_of_rank()[RANK]
    x = np.random.default_rng(RANK).standard_normal(3001)
    expected = np.empty_like(x)
    COMM.Allreduce(x, expected, op=MPI.SUM)
    comm.message_log = []
    try:
        result = C.allreduce(x, algorithm="shm")
        messages = list(comm.message_log)
    finally:
        comm.message_log = None
    np.testing.assert_allclose(result, expected, rtol=1e-12, atol=1e-12 * P)
    segments, _ = comm.shared_segments(x.nbytes)
    assert len(segments) == len(groups[node]), "the window spans more than this rank's node"
    owner = comm.node_of_rank()
    within = [m for m in messages if owner[m[2]] == owner[m[3]]]
    assert not within, f"shm sent messages inside a node: {within[:3]}"
    sent = COMM.allreduce(len(messages), op=MPI.SUM)
    if len(groups) > 1:
        assert sent > 0, "several nodes, but no inter-node step"
    else:
        assert sent == 0
