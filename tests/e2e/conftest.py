"""End-to-end tests run against the session's whole system (`tests.system`); its names are
re-exported here, where the tests have always imported them from."""

from tests.system import STATUS_INTERVAL_S, System, scripted_worker

__all__ = ["STATUS_INTERVAL_S", "System", "scripted_worker"]
