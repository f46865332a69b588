"""Builders shared by the test suite (servers, stores, vLLM runs)."""
