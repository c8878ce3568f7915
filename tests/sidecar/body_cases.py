"""Request bodies in every Content-Type, charset and Content-Encoding a client may send JSON with, for the tests
that check the proxy and the gateway read a version constraint whatever the body says it is."""

from __future__ import annotations

import codecs
import gzip
import json
import zlib
from collections.abc import Callable
from typing import Any

Encoder = Callable[[dict[str, Any]], tuple[bytes, dict[str, str]]]


def _text(doc: dict[str, Any]) -> str:
    return json.dumps(doc)


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


# name -> how a JSON document is sent: its bytes and the headers that describe them.
JSON_BODIES: dict[str, Encoder] = {
    "application/json": lambda d: (_text(d).encode(), {"content-type": "application/json"}),
    "json; charset=utf-8": lambda d: (_text(d).encode(), {"content-type": "application/json; charset=UTF-8"}),
    "text/plain": lambda d: (_text(d).encode(), {"content-type": "text/plain"}),
    "curl's form type": lambda d: (_text(d).encode(), {"content-type": "application/x-www-form-urlencoded"}),
    "no content type": lambda d: (_text(d).encode(), {}),
    "octet-stream": lambda d: (_text(d).encode(), {"content-type": "application/octet-stream"}),
    "vendor +json": lambda d: (_text(d).encode(), {"content-type": "application/vnd.example+json"}),
    "utf-8 BOM": lambda d: (codecs.BOM_UTF8 + _text(d).encode(), {"content-type": "application/json"}),
    "utf-16 BOM, charset": lambda d: (_text(d).encode("utf-16"), {"content-type": "application/json; charset=utf-16"}),
    "utf-16-le, no BOM": lambda d: (_text(d).encode("utf-16-le"), {"content-type": "application/json"}),
    "utf-16-be, text/plain": lambda d: (_text(d).encode("utf-16-be"), {"content-type": "text/plain"}),
    "utf-32 BOM": lambda d: (_text(d).encode("utf-32"), {"content-type": "application/json"}),
    "utf-32-be, no BOM": lambda d: (_text(d).encode("utf-32-be"), {}),
    "utf-16 BOM, charset says utf-8": lambda d: (
        _text(d).encode("utf-16"),
        {"content-type": "application/json; charset=utf-8"},
    ),
    "latin-1 charset": lambda d: (_text(d).encode("latin-1"), {"content-type": "text/plain; charset=ISO-8859-1"}),
    "gzip": lambda d: (
        gzip.compress(_text(d).encode()),
        {"content-type": "application/json", "content-encoding": "gzip"},
    ),
    "gzip, text/plain": lambda d: (
        gzip.compress(_text(d).encode()),
        {"content-type": "text/plain", "content-encoding": "gzip"},
    ),
    "deflate (zlib)": lambda d: (
        zlib.compress(_text(d).encode()),
        {"content-type": "application/json", "content-encoding": "deflate"},
    ),
    "deflate (raw)": lambda d: (
        _raw_deflate(_text(d).encode()),
        {"content-type": "application/json", "content-encoding": "deflate"},
    ),
    "gzip of utf-16": lambda d: (gzip.compress(_text(d).encode("utf-16")), {"content-encoding": "gzip"}),
    "identity": lambda d: (_text(d).encode(), {"content-type": "application/json", "content-encoding": "identity"}),
}

# Bodies that cannot be read as JSON: (bytes, headers, the status expected, a word the message must hold).
UNREADABLE: dict[str, tuple[bytes, dict[str, str], int, str]] = {
    "form fields": (b"prompt=hi&max_tokens=1", {"content-type": "application/x-www-form-urlencoded"}, 415, "not JSON"),
    "text": (b"hello there", {"content-type": "text/plain"}, 415, "text/plain"),
    "malformed json": (b'{"prompt": "hi",', {"content-type": "application/json"}, 400, "not valid JSON"),
    "malformed, no type": (b'{"prompt": ', {}, 400, "no Content-Type"),
    "not utf-8": (b'{"prompt": "\xff\xfe\xfd"}', {"content-type": "application/json; charset=utf-8"}, 400, "JSON"),
    "brotli": (b"\x1b\x03\x00", {"content-type": "application/json", "content-encoding": "br"}, 415, "'br'"),
    "corrupt gzip": (
        b"\x1f\x8b\x08\x00garbage",
        {"content-type": "application/json", "content-encoding": "gzip"},
        400,
        "gzip",
    ),
    "unknown charset": (b'{"prompt": "x"}', {"content-type": "application/json; charset=klingon"}, 415, "klingon"),
    "a list": (b"[1, 2]", {"content-type": "application/json"}, 400, "JSON object"),
    "a string": (b'"prompt"', {"content-type": "application/json"}, 400, "JSON object"),
}


def gzip_bomb(max_bytes: int) -> tuple[bytes, dict[str, str]]:
    """A small gzip body that inflates past ``max_bytes`` (a JSON string of spaces)."""
    data = b'{"prompt": "' + b" " * (max_bytes + 1) + b'"}'
    return gzip.compress(data, 9), {"content-type": "application/json", "content-encoding": "gzip"}
