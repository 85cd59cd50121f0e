"""The sidecar daemon: ``tierstore serve`` (``server``), ``tierstore.connect`` (``client``),
the wire format (``protocol``) and the Prometheus metrics (``metrics``)."""

from .client import RemoteStore, connect

__all__ = ["RemoteStore", "connect"]
