"""Every test starts and ends with the settings the environment asks for (a test that changes a
variable or calls `settings.update` leaves nothing behind).

The test session never reads the user's cache: `mpdl calibrate`'s file and `auto`'s first-use
calibrations live in ~/.cache/mpdl, and a calibration there changes `auto`'s choices (and so the
messages a test counts). XDG_CACHE_HOME and MPDL_COST_MODEL point into a temporary folder of this
process (removed at exit), so `auto` chooses with its defaults. `auto`'s first-use calibration is
off (MPDL_AUTO_CACHE=off, unless the environment names a folder): the tests take no time
measuring; the tests of the first-use calibration turn it on, in temporary folders. The variables
are set here, before any setting is read, so that the `mpdl` commands the tests start (under
mpiexec too) inherit them.

The busy-machine check reads the machine's load and the ranks' share of core time: the tests of
what is done with a calibration take the `quiet_machine` fixture (stand-in readings of a quiet
machine, whatever else runs), and the tests of the check stand in readings of their own."""

import atexit
import os
import shutil
import tempfile

import pytest

from mpdl import settings

_CACHE_HOME = tempfile.mkdtemp(prefix="mpdl-test-cache-")
atexit.register(shutil.rmtree, _CACHE_HOME, ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
os.environ["MPDL_COST_MODEL"] = os.path.join(_CACHE_HOME, "mpdl", "costmodel.json")
os.environ.setdefault("MPDL_AUTO_CACHE", "off")


@pytest.fixture(autouse=True)
def _settings_from_the_environment():
    settings.use(None)
    yield
    settings.use(None)


@pytest.fixture
def quiet_machine(monkeypatch):
    """The busy check sees a quiet machine whatever else runs: no other work's load, every
    measuring rank its full share of core time, any spread of repeated calls taken as noise."""
    from mpdl.tuning import measuring  # noqa: PLC0415

    monkeypatch.setattr(measuring, "load_per_core", lambda ranks_here: 0.0)
    monkeypatch.setattr(measuring, "core_share", lambda since: 1.0)
    monkeypatch.setattr(measuring, "BUSY_SPREAD", float("inf"))


@pytest.fixture
def no_verification():
    """Plans keep `auto`'s choice (verify_runs 0): a test that counts messages counts the
    algorithm's own, not those of a trial of its contenders."""
    previous = settings.update(verify_runs=0)
    yield
    settings.use(previous)


def _skipped_for_want_of_torch(report) -> bool:
    return (os.environ.get("MPDL_REQUIRE_ORACLE") == "1" and report.skipped
            and "torch" in str(report.longrepr).lower())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under MPDL_REQUIRE_ORACLE=1 (`make test` sets it) a test skipped for want of PyTorch fails:
    the PyTorch oracle tests must run."""
    outcome = yield
    report = outcome.get_result()
    if _skipped_for_want_of_torch(report):
        report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a test module skipped whole for want of PyTorch."""
    outcome = yield
    report = outcome.get_result()
    if _skipped_for_want_of_torch(report):
        report.outcome = "failed"
