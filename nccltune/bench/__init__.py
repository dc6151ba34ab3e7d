"""Benchmarking: the rank launcher, the torch worker and NCCL log parsing."""
