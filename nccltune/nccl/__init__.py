"""What nccltune knows of NCCL itself: its INFO log, and the facts read from its sources."""
