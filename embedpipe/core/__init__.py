"""What every stage shares, torch-free: option defaults (``options``), one-line user errors
(``errors``), atomic outputs (``atomic``), ``checksums``, ``progress`` bars, ``devices`` and their
locks, ``host_memory``, ``output_guard`` (no output replaces an input), ``external_sort``,
``locks``."""
