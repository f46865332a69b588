"""Tools that need vLLM (or build inputs for it): not part of the core.

`runner` drives a real vLLM engine in a subprocess (tests, `make demo`, `bench e2e`);
`tiny_model` writes a random-weight model directory vLLM can load. Nothing in the core
(config, keys, storage, meta, staging, tier) imports this package.
"""
