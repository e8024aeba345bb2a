"""embedpipe's version, recorded in every store it writes; below every package that records it."""

__version__ = "0.1.0"
