"""Ends the Ray + Serve that serving test modules share (``helpers.shared_serve``) with the session."""

from __future__ import annotations

from tests.serving.helpers import end_shared_serve


def pytest_sessionfinish(session, exitstatus) -> None:
    end_shared_serve()
