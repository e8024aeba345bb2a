"""Helpers the tests share (not tests themselves): embedding, sharding, the faked GPU, stores,
the workflow runner. Imported as ``helpers.<module>``; tests/ is on sys.path through conftest.py."""
