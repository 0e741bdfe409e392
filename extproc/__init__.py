"""extproc: an admission and flow-control sidecar for LLM serving behind Envoy."""

__version__ = "0.1.0"
