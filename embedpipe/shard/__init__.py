"""``embedpipe shard``: the passes (``passes``), the per-record index (``index``), its column files
on disk (``spill``), where and how files are written (``output``) and the manifest (``manifest``)."""
