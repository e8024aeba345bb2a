"""Fixtures the store tests share."""

from test_merge import results  # noqa: F401 - the merged-store fixture (three shard stores and a manifest)
