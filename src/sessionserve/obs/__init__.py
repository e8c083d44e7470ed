"""Observability: Prometheus metrics and tracing."""
