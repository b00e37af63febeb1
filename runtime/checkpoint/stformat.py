"""Streaming safetensors files with a CRC-32 per tensor.

The files are plain safetensors (8-byte little-endian header length, JSON
header, raw little-endian tensor bytes), readable by ``safetensors.safe_open``
and ``safetensors.torch.load_file``. We write and read them ourselves because
the library builds a whole file in memory before writing it, which doubles
the host memory of a multi-GB shard and cannot checksum as it goes; here each
tensor is written straight from its memory in large chunks while its CRC is
computed beside the write (zlib and file I/O both release the GIL), and read
straight into its destination tensor while the previous chunk is checked.

CRC-32 per tensor rather than one SHA-256 per file: on this machine's CPUs
zlib.crc32 runs at ~2.6 GB/s against ~1.8 GB/s for SHA-256 (see
benchmarks/checkpoint_io.py), it detects truncation and bit rot, which is
what a checkpoint is guarded against, and a per-tensor checksum lets a
reader that needs only some tensors of a file (re-cutting to another rank
count) verify exactly what it reads.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .index import CheckpointError

CHUNK_BYTES = 32 << 20

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored in a checkpoint "
                              f"(supported: {', '.join(str(d) for d in DTYPES)})") from None


def torch_dtype(code: str, where: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[code]
    except KeyError:
        raise CheckpointError(f"{where}: unknown dtype {code!r}") from None


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a file, and its checksum."""
    dtype: str                 # safetensors code, e.g. "F32"
    shape: tuple[int, ...]
    begin: int                 # byte offsets inside the data section
    end: int
    crc32: int

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape),
                "offsets": [self.begin, self.end], "crc32": self.crc32}

    @staticmethod
    def from_json(d: dict) -> "TensorEntry":
        return TensorEntry(d["dtype"], tuple(int(x) for x in d["shape"]),
                           int(d["offsets"][0]), int(d["offsets"][1]), int(d["crc32"]))


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    if t.device.type != "cpu":
        raise CheckpointError(f"tensor on {t.device} given to the checkpoint writer; copy it to host first")
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def build_header(specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, list[tuple[int, int]]]:
    """Header bytes (length prefix included) and the data offsets of each spec (name, dtype code, shape)."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offsets = []
    pos = 0
    for name, code, shape in specs:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=TORCH_DTYPES[code]).element_size()
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets.append((pos, pos + nbytes))
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)        # data section 8-byte aligned, as the reference writer does
    return struct.pack("<Q", len(text)) + text, offsets


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


def write_stream(fd: int, header: bytes, chunks_per_tensor, pool: ThreadPoolExecutor) -> list[int]:
    """Write ``header`` then every tensor's bytes; returns the CRC-32 of each tensor.

    ``chunks_per_tensor`` yields one memoryview per tensor (or an iterable of
    memoryviews for a tensor produced piecewise). The write of a chunk runs in
    ``pool`` while this thread checksums the same chunk.
    """
    _write_all(fd, memoryview(header))
    crcs = []
    for views in chunks_per_tensor:
        if isinstance(views, memoryview):
            views = [views]
        crc = 0
        for view in views:
            for off in range(0, len(view), CHUNK_BYTES):
                chunk = view[off:off + CHUNK_BYTES]
                fut = pool.submit(_write_all, fd, chunk)
                crc = zlib.crc32(chunk, crc)
                fut.result()
        crcs.append(crc)
    return crcs


def write_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, int, dict[str, TensorEntry]]:
    """Write ``tensors`` to ``path`` (not atomically; the caller renames), fsync it.

    Returns (file bytes, CRC-32 of the header, entries by name).
    """
    names = list(tensors)
    specs = [(n, dtype_code(tensors[n].dtype), tuple(tensors[n].shape)) for n in names]
    header, offsets = build_header(specs, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-write") as pool:
            crcs = write_stream(fd, header, (byte_view(tensors[n]) for n in names), pool)
        os.fsync(fd)
        size = os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise"):
            # The data is on disk; do not let a checkpoint push the training set out of the page cache.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    entries = {n: TensorEntry(c, s, b, e, crc) for (n, c, s), (b, e), crc in zip(specs, offsets, crcs)}
    return size, zlib.crc32(header), entries


class ShardFile:
    """A safetensors file opened for reading whole tensors, checked against its record.

    ``expected`` is the file's record from the index (size, header CRC,
    entries); a file that differs from it in any way raises CheckpointError
    naming the file.
    """

    def __init__(self, path: str, expected_size: int | None = None, expected_header_crc: int | None = None):
        self.path = path
        self.name = os.path.basename(path)
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file missing") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
        try:
            self.size = os.fstat(self.fd).st_size
            if expected_size is not None and self.size != expected_size:
                raise CheckpointError(f"{path}: {self.size} bytes, the index records {expected_size} "
                                      f"({'truncated' if self.size < expected_size else 'altered'})")
            head = os.pread(self.fd, 8, 0)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated (no safetensors header)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > min(self.size - 8, 100 << 20):
                raise CheckpointError(f"{path}: header length {hlen} exceeds the file; truncated or not a safetensors file")
            raw = os.pread(self.fd, hlen, 8)
            if expected_header_crc is not None and zlib.crc32(head + raw) != expected_header_crc:
                raise CheckpointError(f"{path}: header checksum mismatch (file altered)")
            try:
                header = json.loads(raw)
            except ValueError:
                raise CheckpointError(f"{path}: header is not valid JSON (file damaged)") from None
            self.data_start = 8 + hlen
            self.metadata = header.pop("__metadata__", {}) or {}
            self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
            end = 0
            for name, h in header.items():
                b, e = h["data_offsets"]
                self.entries[name] = (h["dtype"], tuple(h["shape"]), b, e)
                end = max(end, e)
            if self.data_start + end > self.size:
                raise CheckpointError(f"{path}: truncated ({self.size} bytes, header needs {self.data_start + end})")
        except CheckpointError:
            os.close(self.fd)
            raise
        except (KeyError, TypeError, ValueError):
            os.close(self.fd)
            raise CheckpointError(f"{path}: malformed safetensors header") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "ShardFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, name: str, expected: TensorEntry | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read tensor ``name`` whole (into ``out`` if given), verifying its CRC when ``expected`` is given."""
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing")
        code, shape, b, e = self.entries[name]
        if expected is not None and (expected.dtype, expected.shape, expected.begin, expected.end) != (code, shape, b, e):
            raise CheckpointError(f"{self.path}: tensor {name!r} differs from the index (file altered)")
        dtype = torch_dtype(code, f"{self.path}: {name}")
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.dtype != dtype or out.numel() * out.element_size() != e - b or not out.is_contiguous():
            raise CheckpointError(f"{self.path}: tensor {name!r} does not fit the destination buffer")
        view = byte_view(out) if out.numel() else memoryview(bytearray())
        crc = 0
        pos = self.data_start + b
        # Read chunk i+1 in a worker while this thread checksums chunk i.
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-read") as pool:
            pending = None
            for off in range(0, len(view), CHUNK_BYTES):
                chunk = view[off:off + CHUNK_BYTES]
                fut = pool.submit(self._read_exact, chunk, pos + off)
                if pending is not None:
                    crc = zlib.crc32(pending, crc)
                fut.result()
                pending = chunk
            if pending is not None:
                crc = zlib.crc32(pending, crc)
        if expected is not None and crc != expected.crc32:
            raise CheckpointError(f"{self.path}: tensor {name!r} checksum mismatch (file altered or damaged)")
        return out

    def verify(self, name: str, expected: TensorEntry, scratch: bytearray) -> None:
        """Check tensor ``name`` against its record by reading it through ``scratch`` (no allocation)."""
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing")
        code, shape, b, e = self.entries[name]
        if (expected.dtype, expected.shape, expected.begin, expected.end) != (code, shape, b, e):
            raise CheckpointError(f"{self.path}: tensor {name!r} differs from the index (file altered)")
        buf = memoryview(scratch)
        crc = 0
        pos = self.data_start + b
        while pos < self.data_start + e:
            n = min(len(buf), self.data_start + e - pos)
            self._read_exact(buf[:n], pos)
            crc = zlib.crc32(buf[:n], crc)
            pos += n
        if crc != expected.crc32:
            raise CheckpointError(f"{self.path}: tensor {name!r} checksum mismatch (file altered or damaged)")

    def _read_exact(self, view: memoryview, pos: int) -> None:
        while len(view):
            n = os.preadv(self.fd, [view], pos)
            if n <= 0:
                raise CheckpointError(f"{self.path}: truncated while reading")
            view = view[n:]
            pos += n
