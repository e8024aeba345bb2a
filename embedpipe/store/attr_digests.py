"""``attr_digests`` (format 3): one digest per root attribute, written with the store, so that
an attribute edited, added or removed after the store was written is caught and named.

The root attributes say what the numbers are: ``precision_policy``, ``platform``,
``model_sha256``, ``model_trained``, ``config``, ``layers``, ``pooling``, ``storage_dtype``,
``embed_identity``, ... A store whose ``precision_policy`` or ``platform`` had been rewritten
with h5py validated, was kept by resume and its false value was copied onward by ``--reuse``.
Every root attribute is covered (a store is never changed after it is complete) except
``complete`` (written after the digests, and checked on its own), the encoding tags (checked
by every reader on their own) and ``attr_digests`` itself.
The value is a JSON object ``{name: blake2b-64 hex}`` of each attribute's stored bytes
(:func:`attr_bytes`). docs/store-format.md, "Row digests".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.errors import StoreError

#: the root attribute holding the digests
ATTR_DIGESTS = "attr_digests"
#: root attributes not covered: ``complete`` is written last, after the digests; the encoding
#: tags, which every reader checks on their own (embedpipe.store.encoding)
UNCOVERED = frozenset({"complete", ATTR_DIGESTS, "encoding-type", "encoding-version"})


def _text(value: Any) -> bytes:
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)


def attr_bytes(value: Any) -> bytes:
    """An attribute's value as h5py returns it, as bytes independent of the platform: text as
    UTF-8, string arrays element by element with lengths, numbers little-endian with dtype and shape."""
    if isinstance(value, (str, bytes)):
        return b"s" + _text(value)
    arr = np.asarray(value)
    if arr.dtype.kind in "OSU":
        items = [_text(v) for v in arr.ravel().tolist()]
        return b"a" + repr(arr.shape).encode() + b"".join(len(i).to_bytes(8, "little") + i for i in items)
    le = arr.dtype.newbyteorder("<")
    return b"n" + le.str.encode() + repr(arr.shape).encode() + np.ascontiguousarray(arr).astype(le).tobytes()


def _digest(name: str, value: Any) -> str:
    return hashlib.blake2b(name.encode("utf-8") + b"\0" + attr_bytes(value), digest_size=8).hexdigest()


def current_digests(obj: h5py.HLObject) -> dict[str, str]:
    """``{name: digest}`` of every covered root attribute as it is stored now."""
    return {name: _digest(name, obj.attrs[name]) for name in obj.attrs if name not in UNCOVERED}


def write_attr_digests(f: h5py.File) -> None:
    """Record the digests of the root attributes as written (the writer's and merge's last
    step before ``complete``)."""
    f.attrs[ATTR_DIGESTS] = json.dumps(current_digests(f), sort_keys=True)


def attr_problems(obj: h5py.HLObject) -> list[str]:
    """One line per root attribute that differs from what was written, was added or was
    removed, or the one line saying ``attr_digests`` is missing or not a digest listing."""
    raw = obj.attrs.get(ATTR_DIGESTS)
    if raw is None:
        return [f"root attribute {ATTR_DIGESTS} is missing: a store of this format records the digest of every "
                "root attribute, so this one was edited after it was written"]
    try:
        recorded = json.loads(raw if isinstance(raw, str) else bytes(raw).decode("utf-8"))
    except (ValueError, TypeError, UnicodeDecodeError):
        recorded = None
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        return [f"root attribute {ATTR_DIGESTS} is not a JSON object of digests: edited after the store was written"]
    now = current_digests(obj)
    problems = []
    for name in sorted(set(recorded) | set(now)):
        if name not in now:
            problems.append(f"root attribute {name} was removed after the store was written")
        elif name not in recorded:
            problems.append(f"root attribute {name} was added after the store was written")
        elif now[name] != recorded[name]:
            problems.append(f"root attribute {name} holds another value than was written (blake2b-64 {now[name]}, "
                            f"attr_digests records {recorded[name]}): edited after the store was written")
    return problems


def check_attrs(obj: h5py.HLObject, path: Path | str, action: str = "refusing to read it") -> None:
    """:func:`attr_problems` as one StoreError naming the store and the first attribute."""
    problems = attr_problems(obj)
    if problems:
        more = f" ({len(problems) - 1} more)" if len(problems) > 1 else ""
        raise StoreError(f"{path}: {problems[0]}{more}: {action}; run embedpipe validate {path}")
