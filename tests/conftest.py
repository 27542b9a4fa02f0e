"""Every test starts and ends with the settings the environment asks for (a test that changes a
variable or calls `settings.update` leaves nothing behind).

`auto`'s first-use calibration is off in the tests (MPDL_AUTO_CACHE=off, unless the environment
names a folder): they choose with the calibration file or the defaults, take no time measuring,
and never write into the user's cache. The tests of the first-use calibration turn it on, in
temporary folders. The variable is set here, before any setting is read, so that the `mpdl`
commands the tests start inherit it."""

import os

import pytest

from mpdl import settings

os.environ.setdefault("MPDL_AUTO_CACHE", "off")


@pytest.fixture(autouse=True)
def _settings_from_the_environment():
    settings.use(None)
    yield
    settings.use(None)
