"""Fixtures of the integration tests: a real `hf3fsctl serve` process."""

from helpers.servers import metadata_server

__all__ = ["metadata_server"]
