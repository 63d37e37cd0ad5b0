"""Read and write graph files: .json, or zstd-compressed .json.zst."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

_ZSTD_LEVEL = 19


def _compress(data: bytes) -> bytes:
    try:
        import zstandard
    except ImportError:
        zstandard = None
    if zstandard is not None:
        return zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True).compress(data)
    binary = shutil.which("zstd")
    if binary is None:
        raise RuntimeError("[fx_export] writing .zst needs the zstandard package or the zstd binary")
    return subprocess.run([binary, "-q", f"-{_ZSTD_LEVEL}", "-c"], input=data,
                          stdout=subprocess.PIPE, check=True).stdout


def _decompress(data: bytes) -> bytes:
    try:
        import zstandard
    except ImportError:
        zstandard = None
    if zstandard is not None:
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    binary = shutil.which("zstd")
    if binary is None:
        raise RuntimeError("[fx_export] reading .zst needs the zstandard package or the zstd binary")
    return subprocess.run([binary, "-q", "-d", "-c"], input=data,
                          stdout=subprocess.PIPE, check=True).stdout


def dumps(graph: dict) -> str:
    """Compact JSON text; rejects NaN/Infinity, which JSON cannot express."""
    return json.dumps(graph, separators=(",", ":"), allow_nan=False)


def save(graph: dict, path: str | os.PathLike) -> None:
    """Write graph to path, zstd-compressed when the name ends in .zst.

    Writes to a temporary file beside path and renames it, so a failure leaves
    any existing file untouched.
    """
    path = os.fspath(path)
    data = (dumps(graph) + "\n").encode("utf-8")
    if path.endswith(".zst"):
        data = _compress(data)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def load(path: str | os.PathLike) -> dict:
    """Read a graph file written by save() (or by the C++ save_graph)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".zst"):
        data = _decompress(data)
    return json.loads(data.decode("utf-8"))
