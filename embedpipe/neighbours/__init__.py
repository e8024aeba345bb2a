"""Nearest neighbours over a store: ``embedpipe index`` and the search of an index (docs/python.md)."""
