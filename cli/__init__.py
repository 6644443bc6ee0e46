"""The ``voxpipe`` command line: serve, ask, mic, bench."""
