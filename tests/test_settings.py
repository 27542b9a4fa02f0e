"""The settings object: what the environment asks for, and who follows a change made at run time."""

from __future__ import annotations

import os
import tempfile

import pytest

from mpdl import emulation, settings
from mpdl.tuning import auto
from mpdl.tuning import costmodel as cm


def test_environment_is_read_once_and_validated(monkeypatch):
    monkeypatch.setenv("MPDL_TIMEOUT", "12")
    monkeypatch.setenv("MPDL_EMULATE", "inter=1Gbit/s,5us")
    settings.use(None)
    first = settings.current()
    assert first.timeout == 12.0 and first.emulation == emulation.parse("inter=1Gbit/s,5us")
    monkeypatch.setenv("MPDL_TIMEOUT", "13")
    assert settings.current() is first  # read once
    for var, bad in (("MPDL_CUDA_AWARE", "yes"), ("MPDL_EMULATE", "outer=1Gbit/s"),
                     ("MPDL_RANKS_PER_NODE", "0")):
        with pytest.raises(ValueError, match=var):
            settings.Settings.from_environment({var: bad})


def test_a_communicator_built_after_a_change_gets_its_links():
    from mpi4py import MPI

    from mpdl.comm import MPIComm

    slow = emulation.parse("inter=1Gbit/s,20us")
    previous = settings.update(emulation=slow)
    comm = MPIComm(MPI.COMM_SELF.Dup())
    try:
        assert emulation.active(comm) == slow and settings.current().emulation == slow
    finally:
        comm.mpi.Free()
    settings.use(previous)
    assert settings.current().emulation == previous.emulation


def test_auto_follows_a_settings_change():
    call = ("allreduce", 1 << 24, 4, 2, False)
    settings.update(cost_model="off")
    assert auto.choose(*call) == auto.simple_choice(*call)
    slow = emulation.parse("inter=10Gbit/s,20us")
    settings.update(cost_model="defaults", emulation=slow)
    assert auto.choose(*call) == cm.fastest(*call, cm.Params().emulated(slow))
    assert auto.choose(*call) in ("hierarchical", "torus2d")


def test_every_formula_times_a_registered_algorithm():
    from mpdl.collectives import registry

    for collective, formulas in cm.FORMULAS.items():
        assert set(formulas) <= set(registry.REGISTRY[collective])


def test_the_test_session_never_reads_the_users_cache():
    """tests/conftest.py points the cache (and the calibration file) at a temporary folder of the
    session, which the `mpdl` commands the tests start inherit: a user's `mpdl calibrate` file in
    ~/.cache/mpdl never changes what the tests see."""
    user_cache = os.path.join(os.path.expanduser("~"), ".cache")
    temporary = tempfile.gettempdir()
    for path in (os.environ["XDG_CACHE_HOME"], settings.current().cost_model):
        assert path.startswith(temporary) and not path.startswith(user_cache), path
    assert not os.path.exists(settings.current().cost_model)
