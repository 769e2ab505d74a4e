"""`open_store(location)`: the checkpoint store for a location, apart from the stores themselves
(so that no store imports another one's module to be chosen).

`s3://bucket/prefix` opens an `ObjectCheckpointStore` (objectstore/store.py; the `s3` extra, loaded
only then), anything else a `CheckpointStore` on that directory (store.py). Both implement
`types.Store`.
"""
from __future__ import annotations

import os
from typing import Any

from .objectstore.url import is_object_store_url
from .store import CheckpointStore
from .types import Store


def open_store(location: str | os.PathLike, keep_last: int = 3, **options: Any) -> Store:
    """The store for `location` (see the module docstring); `options` go to its constructor
    (for an object store: objectstore/store.py)."""
    if is_object_store_url(location):
        from .objectstore.store import ObjectCheckpointStore

        return ObjectCheckpointStore(str(location), keep_last=keep_last, **options)
    return CheckpointStore(location, keep_last=keep_last, **options)
