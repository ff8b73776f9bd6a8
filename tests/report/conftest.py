"""One headless Chromium for the module's browser tests."""

from __future__ import annotations

import pytest

from .browser import available, browser


@pytest.fixture(scope="module")
def chrome():
    why = available()
    if why is not None:  # .ci/run installs them: a missing browser is an error, not a skip
        pytest.fail(f"the report's browser tests need Chromium: {why}")
    with browser() as driver:
        yield driver
