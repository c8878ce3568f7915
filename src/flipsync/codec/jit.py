"""``kernel``: numba's ``njit(nogil=True, cache=True)`` with an on-disk cache that processes can share.

numba numbers a function's cached data files by the order signatures arrive, so two processes compiling two
signatures at once can both take file 1, and the index then sends one signature to the other's machine code
(numba#10128: "can't unbox array", or a crash). Here each signature's file is named by a hash of its key."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numba
from numba.core import caching


class _SignatureFiles(caching.IndexDataCacheFile):
    def save(self, key: Any, data: Any) -> None:
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).hexdigest()
        name = f"{self._index_name.removesuffix('.nbi')}.{digest}.nbc"
        self._save_data(name, data)  # the data first: an index never names a file not yet written
        self._save_index(self._load_index() | {key: name})  # a racing save may drop this entry: a miss, not an error


class _SharedCache(caching.FunctionCache):
    def __init__(self, py_func: Callable[..., Any]) -> None:
        super().__init__(py_func)
        stamp = self._impl.locator.get_source_stamp()
        self._cache_file = _SignatureFiles(self._cache_path, self._impl.filename_base, stamp)


def kernel(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``@kernel`` or ``@kernel(**njit_options)``: ``fn`` as a nogil numba kernel, cached on disk per signature."""
    if fn is None:
        return lambda f: kernel(f, **options)
    dispatcher = numba.njit(nogil=True, **options)(fn)
    dispatcher._cache = _SharedCache(fn)  # where numba's own cache=True puts its cache (Dispatcher.enable_caching)
    return dispatcher
