"""Checks of a node against what was published: verify (a short re-measurement and what NCCL ran),
doctor (the node's readiness and the site's own NCCL settings), and the topology file check."""
