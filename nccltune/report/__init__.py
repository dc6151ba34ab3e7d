"""What nccltune shows: text tables and JSON documents by family (node, sweep, runs; the JSON rules
in common), the plot of a run, and nccl-tests' -J documents read and written. Strings and files
only: nothing here measures, decides or publishes."""
