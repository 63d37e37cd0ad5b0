"""Read and write graph files: .json, or zstd-compressed .json.zst.

zstd comes from the zstandard package, else the zstd command, else libzstd
itself through ctypes (the GPU machine has only the library).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import shutil
import subprocess

_ZSTD_LEVEL = 19
_ZSTD_C_COMPRESSION_LEVEL = 100  # ZSTD_cParameter values of zstd.h
_ZSTD_C_CHECKSUM_FLAG = 201


@functools.cache
def _libzstd() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("zstd") or "libzstd.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    size_t, void_p = ctypes.c_size_t, ctypes.c_void_p
    lib.ZSTD_compressBound.restype = size_t
    lib.ZSTD_compressBound.argtypes = [size_t]
    lib.ZSTD_createCCtx.restype = void_p
    lib.ZSTD_freeCCtx.argtypes = [void_p]
    lib.ZSTD_CCtx_setParameter.restype = size_t
    lib.ZSTD_CCtx_setParameter.argtypes = [void_p, ctypes.c_int, ctypes.c_int]
    lib.ZSTD_compress2.restype = size_t
    lib.ZSTD_compress2.argtypes = [void_p, void_p, size_t, ctypes.c_char_p, size_t]
    lib.ZSTD_createDStream.restype = void_p
    lib.ZSTD_freeDStream.argtypes = [void_p]
    lib.ZSTD_decompressStream.restype = size_t
    lib.ZSTD_decompressStream.argtypes = [void_p, void_p, void_p]
    lib.ZSTD_isError.restype = ctypes.c_uint
    lib.ZSTD_isError.argtypes = [size_t]
    lib.ZSTD_getErrorName.restype = ctypes.c_char_p
    lib.ZSTD_getErrorName.argtypes = [size_t]
    return lib


def _checked(lib: ctypes.CDLL, code: int, call: str) -> int:
    if lib.ZSTD_isError(code):
        raise RuntimeError(f"[fx_export] libzstd {call}: {lib.ZSTD_getErrorName(code).decode()}")
    return code


def _compress_with_libzstd(lib: ctypes.CDLL, data: bytes) -> bytes:
    """One frame with a content checksum, as the zstandard package writes it."""
    context = lib.ZSTD_createCCtx()
    if not context:
        raise RuntimeError("[fx_export] libzstd ZSTD_createCCtx failed")
    try:
        _checked(lib, lib.ZSTD_CCtx_setParameter(context, _ZSTD_C_COMPRESSION_LEVEL, _ZSTD_LEVEL),
                 "ZSTD_CCtx_setParameter(compressionLevel)")
        _checked(lib, lib.ZSTD_CCtx_setParameter(context, _ZSTD_C_CHECKSUM_FLAG, 1),
                 "ZSTD_CCtx_setParameter(checksumFlag)")
        capacity = lib.ZSTD_compressBound(len(data))
        out = ctypes.create_string_buffer(capacity)
        size = _checked(lib, lib.ZSTD_compress2(context, out, capacity, data, len(data)),
                        "ZSTD_compress2")
        return out.raw[:size]
    finally:
        lib.ZSTD_freeCCtx(context)


class _Buffer(ctypes.Structure):  # ZSTD_inBuffer and ZSTD_outBuffer
    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_size_t), ("pos", ctypes.c_size_t)]


def _decompress_with_libzstd(lib: ctypes.CDLL, data: bytes) -> bytes:
    """Every frame of data, streamed (a frame need not record its size)."""
    stream = lib.ZSTD_createDStream()
    if not stream:
        raise RuntimeError("[fx_export] libzstd ZSTD_createDStream failed")
    try:
        source = ctypes.create_string_buffer(data, len(data))
        chunk = ctypes.create_string_buffer(1 << 20)
        given = _Buffer(ctypes.cast(source, ctypes.c_void_p), len(data), 0)
        pieces = []
        remaining = 1
        while given.pos < given.size or remaining != 0:
            out = _Buffer(ctypes.cast(chunk, ctypes.c_void_p), len(chunk), 0)
            before = given.pos
            remaining = _checked(lib, lib.ZSTD_decompressStream(
                stream, ctypes.byref(out), ctypes.byref(given)), "ZSTD_decompressStream")
            pieces.append(chunk.raw[:out.pos])
            if out.pos == 0 and given.pos == before:
                raise RuntimeError("[fx_export] libzstd: truncated .zst data")
        return b"".join(pieces)
    finally:
        lib.ZSTD_freeDStream(stream)


def _compress(data: bytes) -> bytes:
    try:
        import zstandard
    except ImportError:
        zstandard = None
    if zstandard is not None:
        return zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True).compress(data)
    binary = shutil.which("zstd")
    if binary is None:
        lib = _libzstd()
        if lib is None:
            raise RuntimeError(
                "[fx_export] writing .zst needs the zstandard package, the zstd binary or libzstd")
        return _compress_with_libzstd(lib, data)
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
        lib = _libzstd()
        if lib is None:
            raise RuntimeError(
                "[fx_export] reading .zst needs the zstandard package, the zstd binary or libzstd")
        return _decompress_with_libzstd(lib, data)
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
