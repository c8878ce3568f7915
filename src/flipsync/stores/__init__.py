"""Stores: the `Store` port (`base`) with its implementations beside it (`object_store`: obstore for paths,
``memory://``, S3, GCS and Azure; `http`: an island relay), the classification of their failures (`errors`),
and `open_store`, the one place a URL picks an implementation (docs/board.md)."""

from __future__ import annotations

import os

from flipsync.stores.base import ObjectInfo, Store, StoreOptions, StoreWrapper, WaitingStore
from flipsync.stores.http import HttpStore, is_relay_url
from flipsync.stores.object_store import ObstoreStore, open_object_store

__all__ = [
    "HttpStore",
    "ObjectInfo",
    "ObstoreStore",
    "Store",
    "StoreOptions",
    "StoreWrapper",
    "WaitingStore",
    "is_relay_url",
    "open_store",
]


def open_store(url: str | os.PathLike[str] | Store, options: StoreOptions | None = None) -> Store:
    """The store a board URL names: a relay (``http://HOST:PORT``) through `HttpStore`, anything else through
    obstore (`open_object_store`); a `Store` as it is."""
    if isinstance(url, Store):
        return url
    return HttpStore(str(url)) if is_relay_url(str(url)) else open_object_store(url, options)
