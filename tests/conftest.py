"""Every test starts and ends with the settings the environment asks for (a test that changes a
variable or calls `settings.update` leaves nothing behind)."""

import pytest

from mpdl import settings


@pytest.fixture(autouse=True)
def _settings_from_the_environment():
    settings.use(None)
    yield
    settings.use(None)
