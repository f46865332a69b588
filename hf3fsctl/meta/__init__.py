"""Metadata: the SQLite store, the HTTP service, and the clients of both."""
