"""Server runs that more than one e2e module checks: each starts, serves, stops and returns
its results once per session (a server start costs ~20 s of the suite's two cores)."""

from __future__ import annotations

import pytest

from tests.support.pressure import serve_under_pressure


@pytest.fixture(scope="session")
def pressure_run(tmp_path_factory):
    """The KV-pressure server's retraction and modes phases (tests/support/pressure.py)."""
    return serve_under_pressure(tmp_path_factory.mktemp("pressure"))
