"""Files root may rely on: the trust rule for paths read as configuration, atomic writes, the sweep
lock, and bounded reading of input files."""
