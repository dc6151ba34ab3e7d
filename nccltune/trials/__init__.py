"""Trials: the rank launcher (runner), the rank program (worker) and the nccl-tests adapter."""
