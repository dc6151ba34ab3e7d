"""Topology: snapshot -> model, NCCL path types, fingerprint, NCCL XML write/read."""
