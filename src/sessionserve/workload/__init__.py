"""Agent workloads: trace schema, loaders for public traces, replay."""
