"""``embedpipe embed``: one FASTA into one store (``run``), the batch engine (``engine``), windows and
batches (``planning``), the token budget (``budget``), per-piece outputs (``pooling``), the store
writes on their own thread (``writer_thread``) and the group markers (``group_marker``)."""
