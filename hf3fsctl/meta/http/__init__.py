"""The HTTP client of `hf3fsctl serve`: `HttpMetadataClient` (`client.py`: the calls, their
retries and the one error-mapping point) over the transports of `transport.py`."""

from hf3fsctl.meta.http.client import HttpMetadataClient

__all__ = ["HttpMetadataClient"]
