"""Hardware readers. Each returns frozen snapshots (hw.types) that round-trip through JSON."""
