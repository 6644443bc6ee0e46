"""voxpipe benchmarks: each prints a table (and JSON with ``--json``)."""
