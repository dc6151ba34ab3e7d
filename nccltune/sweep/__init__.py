"""Sweep: search space, topology-aware pruning, plan, search strategy and selection."""
