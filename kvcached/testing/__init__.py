"""What the tests and the benchmarks share, shipped with the product so that neither imports the
other: real daemon processes (``daemon_proc``), a minimal engine process (``engine_proc``), an
in-process fake daemon for the connector's unit tests (``fake_daemon``), and the scenarios both
drive."""
