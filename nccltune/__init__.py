"""nccltune: topology-aware NCCL tuning for GPU nodes."""

__version__ = "0.2.0"
