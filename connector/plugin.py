"""vLLM plugin entry point (`vllm.general_plugins`): registers `Hf3fsctlConnector`.

vLLM runs every general plugin in every process it starts (API server, engine core,
workers), and `KVConnectorFactory.register_connector` raises on a duplicate name, so
registration is guarded: a name already registered (by us or anyone) is left alone.
The class itself is imported lazily by vLLM, only when the connector is selected.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "Hf3fsctlConnector"
CONNECTOR_MODULE = "hf3fsctl_connector.connector"

logger = logging.getLogger(__name__)


def register() -> None:
    """Register the connector with vLLM's factory (idempotent)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM absent: nothing to register with
        return
    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # registered concurrently: fine
        logger.debug("%s was already registered", CONNECTOR_NAME)
