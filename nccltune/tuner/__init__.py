"""nccltune's NCCL tuner plugin: the C source (built on the node), its table format, and the builder."""
