"""Fixtures the speculative-decoding tests share with the executor's."""

from tests.executor.conftest import checkpoint_cache  # noqa: F401 (a fixture, registered here)
