"""Host staging of device arrays: buffers are reused, never while a message that uses them is in flight."""

import numpy as np
import pytest

from mpdl.backend import get_array_module, standin
from mpdl.comm import StagingPool


def test_pool_never_lends_a_buffer_twice_and_reuses_released_ones():
    pool = StagingPool(lambda n: np.empty(n, np.uint8))
    a = pool.acquire(1000)
    b = pool.acquire(1000)
    assert a is not b and not np.shares_memory(a, b)
    pool.release(a)
    c = pool.acquire(900)  # same size class: the released buffer comes back
    assert c is a and pool.allocations == 2
    assert len(pool.in_flight) == 2


def test_stand_in_device_array_refuses_implicit_host_access():
    x = standin.asarray(np.arange(4.0))
    assert get_array_module(x) is standin
    with pytest.raises(TypeError, match="implicit conversion"):
        np.asarray(x)
    with pytest.raises(TypeError, match="mixed"):
        standin.add(x, np.ones(4))
    np.testing.assert_array_equal(standin.asnumpy(standin.add(x, x)), [0, 2, 4, 6])


@pytest.mark.parametrize("variable, read", [("MPDL_STAGING_CHUNK_BYTES", "staging_chunk_bytes"),
                                            ("MPDL_RANKS_PER_NODE", "ranks_per_node_override")])
def test_size_variables_reject_what_is_not_a_positive_integer(monkeypatch, variable, read):
    from mpdl import comm, settings

    for bad in ("0", "-4", "4M", "two"):
        monkeypatch.setenv(variable, bad)
        settings.use(None)
        with pytest.raises(ValueError, match=f"{variable}: expected a positive integer"):
            getattr(comm, read)()
    monkeypatch.setenv(variable, "4096")
    settings.use(None)
    assert getattr(comm, read)() == 4096
    monkeypatch.delenv(variable)
    settings.use(None)
    assert comm.staging_chunk_bytes() == 4 << 20 and comm.ranks_per_node_override() is None
