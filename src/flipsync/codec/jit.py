"""numba for the kernels: ``kernel``, numba's ``njit(nogil=True, cache=True)`` with a cache processes can share,
and CPU instructions numba has no builtin for (count leading zeros, a 64x64-bit multiply's high half, prefetch).

numba numbers a function's cached files in the order signatures arrive, so two processes compiling two
signatures at once could both take file 1 and the index send one signature to the other's machine code
(numba#10128: "can't unbox array", or a crash). Here each signature's file is named by a hash of its key, and
each numba version keeps files of its own."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numba
from llvmlite import ir
from numba import types
from numba.core import caching, cgutils
from numba.extending import intrinsic


class _SignatureFiles(caching.IndexDataCacheFile):
    def save(self, key: Any, data: Any) -> None:
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).hexdigest()
        name = f"{self._index_name.removesuffix('.nbi')}.{digest}.nbc"
        self._save_data(name, data)  # the data first: an index never names a file not yet written
        self._save_index(self._load_index() | {key: name})  # a racing save may drop this entry: a miss, not an error


def kernel(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``@kernel`` or ``@kernel(**njit_options)``: ``fn`` as a nogil numba kernel, cached on disk per signature."""
    if fn is None:
        return lambda f: kernel(f, **options)
    dispatcher = numba.njit(nogil=True, cache=True, **options)(fn)
    cache = dispatcher._cache  # numba's FunctionCache (Dispatcher.enable_caching): keep it, swap its files for ours
    base, stamp = cache._impl.filename_base, cache._cache_file._source_stamp  # named apart: numba's index may be bad
    # numba's version in the names: an index written by another numba is dropped whole on load (vLLM's CPU build
    # pins an older numba than the library's), so two environments sharing this folder recompiled after each other
    cache._cache_file = _SignatureFiles(cache.cache_path, f"{base}.bykey-{numba.__version__}", stamp)
    return dispatcher


@intrinsic
def clz64(typingctx: Any, x: Any) -> Any:
    """Count leading zeros of a uint64 (one instruction; 64 for zero)."""
    sig = types.uint64(types.uint64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 0))

    return sig, codegen


@intrinsic
def mulhi64(typingctx: Any, a: Any, b: Any) -> Any:
    """The high 64 bits of the 128-bit product of two uint64 (one ``mul`` on x86-64; numba has no int128)."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        wide = ir.IntType(128)
        prod = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        return builder.trunc(builder.lshr(prod, ir.Constant(wide, 64)), ir.IntType(64))

    return sig, codegen


def _prefetch(write: int) -> Any:
    def typer(typingctx: Any, arr: Any, idx: Any) -> Any:
        sig = types.void(arr, idx)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            i8p = ir.IntType(8).as_pointer()
            addr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8"
            )
            builder.call(fn, [addr, ir.Constant(i32, write), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return sig, codegen

    return typer


# llvm.prefetch(&arr[idx], read or write, high locality): hints only, they never fault.
prefetch_read = intrinsic(_prefetch(0))
prefetch_write = intrinsic(_prefetch(1))
