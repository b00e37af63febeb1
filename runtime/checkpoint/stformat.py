"""Streaming safetensors files with a CRC-32 per 16 MiB block of each tensor.

The files are plain safetensors (8-byte little-endian header length, JSON
header, raw little-endian tensor bytes), readable by ``safetensors.safe_open``
and ``safetensors.torch.load_file``. We write and read them ourselves because
the library builds a whole file in memory before writing it, which doubles
the host memory of a multi-GB shard and cannot checksum as it goes; here
each tensor streams from its own memory to the disk (directio.Sink) while
its checksums are computed, and is read back by DMA into its destination
while the previous chunk is checked (directio.Source).

A CRC per block rather than one hash per file: a CRC detects truncation and
bit rot, which is what a checkpoint is guarded against, at a fraction of the
CPU; and checksums per block let a reader that needs only a slice of a tensor
(re-cutting shards to another rank count) read and verify just the blocks
that hold the slice. Blocks use CRC-32C (runtime/io/checksum.py), each entry
recording its algorithm; the header's checksum in the index is zlib's CRC-32.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from zdsl.runtime.checkpoint.errors import CheckpointError
from zdsl.runtime.checkpoint.index import PAD_PREFIX, TensorEntry
from zdsl.runtime.io import checksum
from zdsl.runtime.io.aligned import ALIGN
from zdsl.runtime.io.directio import ZERO_COPY_MIN, FileIOError, Sink, Source, as_bytes

CRC_BLOCK = 16 << 20      # bytes per checksum block
WRITE_SPAN = 64 << 20     # bytes per write handed to the disk (a whole number of blocks)



def checksum_fn(algo: str, where: str) -> checksum.Checksum:
    """``f(data, value=0) -> int`` for checksum ``algo`` as recorded in an entry."""
    fn = checksum.by_name(algo)
    if fn is not None:
        return fn
    if algo == "crc32c":
        raise CheckpointError(f"{where}: written with CRC-32C checksums; `pip install crc32c` to verify "
                              f"it (or load with verify=False)")
    raise CheckpointError(f"{where}: unknown checksum {algo!r}")


@contextmanager
def read_errors():
    """A failed or short read of a shard file is a damaged checkpoint."""
    try:
        yield
    except FileIOError as e:
        raise CheckpointError(e.strerror) from None


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


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    if t.device.type != "cpu":
        raise CheckpointError(f"tensor on {t.device} given to the checkpoint writer; copy it to host first")
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


@dataclass(frozen=True)
class LazyShard:
    """A tensor the writer fetches only when its turn comes (e.g. an optimizer shard living on NVMe).

    ``fetch()`` must return a CPU tensor of ``shape`` and ``dtype``; it is
    called once, right before the tensor is written, and dropped after, so a
    rank's save holds one such tensor in host memory at a time.
    """
    shape: tuple[int, ...]
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor]

    def dim(self) -> int:
        return len(self.shape)


def _materialise(name: str, t) -> memoryview:
    if isinstance(t, LazyShard):
        got = t.fetch()
        if tuple(got.shape) != tuple(t.shape) or got.dtype != t.dtype:
            raise CheckpointError(f"shard {name}: fetched {got.dtype}{list(got.shape)}, "
                                  f"declared {t.dtype}{list(t.shape)}")
        t = got
    return byte_view(t)


def _nbytes(code: str, shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=TORCH_DTYPES[code]).element_size()


LayoutEntry = tuple[str, str, tuple[int, ...], int, int]   # name, dtype code, shape, begin, end


def build_header(specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str],
                 page_offsets: list[int | None] | None = None) -> tuple[bytes, list[LayoutEntry]]:
    """Header bytes (length prefix included) and the layout: (name, dtype code, shape, begin, end) in file order.

    ``page_offsets``: per spec, the offset within a 4 KiB page its bytes
    should start at (that of the memory it is written from), or None. With
    it the data section starts on a page boundary and a padding tensor
    (``__pad.N``, zeros) goes before each tensor as needed, so tensor and
    memory are congruent and O_DIRECT moves the bytes without a copy.
    Without it: the reference writer's layout (data 8-byte aligned).
    """
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    layout: list[LayoutEntry] = []
    pos = 0
    for i, (name, code, shape) in enumerate(specs):
        want = page_offsets[i] if page_offsets else None
        if want is not None and (want - pos) % ALIGN:
            pad = (want - pos) % ALIGN
            layout.append((f"{PAD_PREFIX}{i}", "U8", (pad,), pos, pos + pad))
            pos += pad
        nbytes = _nbytes(code, shape)
        layout.append((name, code, tuple(shape), pos, pos + nbytes))
        pos += nbytes
    for name, code, shape, b, e in layout:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [b, e]}
    text = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces (JSON whitespace): to a page when asked, else to 8 as the reference writer does.
    text += b" " * (-(8 + len(text)) % ALIGN if page_offsets else -len(text) % 8)
    return struct.pack("<Q", len(text)) + text, layout


def write_stream(sink: Sink, header: bytes, tensors) -> list[tuple[int, ...]]:
    """Write ``header`` then each tensor's bytes (``tensors`` yields one memoryview per tensor).

    Returns the block CRCs of each tensor; the sink's worker writes one
    block while this thread checksums the next.
    """
    sink.write(memoryview(header))
    crc = checksum.DEFAULT
    crcs = []
    span = max(CRC_BLOCK, WRITE_SPAN // CRC_BLOCK * CRC_BLOCK)
    for view in tensors:
        blocks: list[int] = []
        for off in range(0, len(view), span):
            chunk = view[off:off + span]
            blocks.extend(crc(chunk[b:b + CRC_BLOCK]) for b in range(0, len(chunk), CRC_BLOCK))
            sink.write(chunk)
        crcs.append(tuple(blocks))
    return crcs


def write_new_file(path: str, header: bytes, tensors) -> tuple[int, list[tuple[int, ...]]]:
    """Create ``path`` holding ``header`` then ``tensors`` (memoryviews), fsynced; (bytes, block CRCs)."""
    sink = Sink(path)
    try:
        crcs = write_stream(sink, header, tensors)
        return sink.close(), crcs
    finally:
        sink.abort()


def write_file(path: str, tensors: dict, metadata: dict[str, str]) -> tuple[int, int, dict[str, TensorEntry]]:
    """Write ``tensors`` (torch.Tensor or LazyShard) to ``path`` (not atomically; the caller renames), fsync it.

    Returns (file bytes, CRC-32 of the header, entries by name, padding included).
    """
    # Widest elements first: every tensor then starts at a multiple of its element size.
    names = sorted(tensors, key=lambda n: -torch.empty((), dtype=tensors[n].dtype).element_size())
    specs = [(n, dtype_code(tensors[n].dtype), tuple(tensors[n].shape)) for n in names]
    # Large in-memory tensors start in the file at their address's offset within a page (a
    # LazyShard's memory is unknown until fetched: page start, as pinned buffers are).
    page_offsets = []
    for n in names:
        t = tensors[n]
        big = _nbytes(dtype_code(t.dtype), t.shape) >= ZERO_COPY_MIN
        page_offsets.append(None if not big else
                            t.data_ptr() % ALIGN if isinstance(t, torch.Tensor) and t.is_contiguous() else 0)
    header, layout = build_header(specs, metadata, page_offsets)

    def views():
        for name, code, shape, b, e in layout:
            yield memoryview(bytes(e - b)) if name.startswith(PAD_PREFIX) else _materialise(name, tensors[name])

    size, crcs = write_new_file(path, header, views())
    entries = {name: TensorEntry(code, shape, b, e, crc, CRC_BLOCK, checksum.DEFAULT.algo)
               for (name, code, shape, b, e), crc in zip(layout, crcs)}
    return size, checksum.CRC32(header), entries


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
                raise CheckpointError(f"{path}: header length {hlen} exceeds the file; "
                                      "truncated or not a safetensors file")
            raw = os.pread(self.fd, hlen, 8)
            if expected_header_crc is not None and checksum.CRC32(head + raw) != expected_header_crc:
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
                begin, stop = h["data_offsets"]
                self.entries[name] = (h["dtype"], tuple(h["shape"]), begin, stop)
                end = max(end, stop)
            if self.data_start + end > self.size:
                raise CheckpointError(f"{path}: truncated ({self.size} bytes, header needs {self.data_start + end})")
            self.source = Source(path, self.fd)
        except CheckpointError:
            os.close(self.fd)
            raise
        except (KeyError, TypeError, ValueError):
            os.close(self.fd)
            raise CheckpointError(f"{path}: malformed safetensors header") from None

    def close(self) -> None:
        if self.fd >= 0:
            self.source.close()
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "ShardFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _entry(self, name: str, expected: TensorEntry | None):
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing")
        code, shape, b, e = self.entries[name]
        found = (code, shape, b, e)
        if expected is not None and (expected.dtype, expected.shape, expected.begin, expected.end) != found:
            raise CheckpointError(f"{self.path}: tensor {name!r} differs from the index (file altered)")
        return code, shape, b, e

    def read(self, name: str, expected: TensorEntry | None = None) -> torch.Tensor:
        """Tensor ``name`` whole, its blocks checked against ``expected`` when given."""
        code, shape, b, e = self._entry(name, expected)
        dtype = torch_dtype(code, f"{self.path}: {name}")
        check = BlockCheck(self.path, name, expected, e - b, 0) if expected is not None else None
        with read_errors():
            flat = self.source.read_tensor(self.data_start + b, e - b, dtype, check.feed if check else None)
        if flat is None:                   # no direct I/O here: through bounce buffers
            out = torch.empty(shape, dtype=dtype)
            self.read_range(name, expected, 0, e - b, byte_view(out))
            return out
        if check:
            check.done()
        return flat.reshape(shape)

    def verify(self, name: str, expected: TensorEntry) -> None:
        """Check every block of tensor ``name`` against its record, keeping nothing."""
        code, shape, b, e = self._entry(name, expected)
        self.read_range(name, expected, 0, e - b, None)

    def read_range(self, name: str, expected: TensorEntry | None, lo: int, hi: int,
                   dest: memoryview | None) -> None:
        """Bytes [lo, hi) of tensor ``name`` into ``dest`` (None: only check), checking every block touched.

        With ``expected`` the read widens to whole checksum blocks, so a
        slice (re-cutting to another rank count) is verified like a whole
        tensor; the bytes outside [lo, hi) are checked, not copied.
        """
        code, shape, b, e = self._entry(name, expected)
        size = e - b
        if not 0 <= lo <= hi <= size or (dest is not None and len(dest) != hi - lo):
            raise CheckpointError(f"{self.path}: bad range [{lo}, {hi}) of tensor {name!r}")
        start, end, check = lo, hi, None
        if expected is not None:
            blk = expected.block
            start, end = lo - lo % blk, min(-(-hi // blk) * blk, size)
            check = BlockCheck(self.path, name, expected, size, start)
        out = as_bytes(dest) if dest is not None else None
        base = self.data_start + b
        if out is not None and (start, end) == (lo, hi):
            # The range is whole checksum blocks: straight into the destination when it is congruent.
            with read_errors():
                read = self.source.read_into(base + lo, out, check.feed if check else None)
            if read:
                if check:
                    check.done()
                return
        pos = start
        with read_errors():
            for piece in self.source.pieces(base + start, base + end):
                p1 = pos + len(piece)
                c0, c1 = max(pos, lo), min(p1, hi)
                if out is not None and c0 < c1:
                    out[c0 - lo:c1 - lo].copy_(as_bytes(piece)[c0 - pos:c1 - pos])
                if check:
                    check.feed(piece)
                pos = p1
        if check:
            check.done()


class BlockCheck:
    """CRC-32 of consecutive bytes of one tensor, compared block by block with its record."""

    def __init__(self, path: str, name: str, expected: TensorEntry, size: int, start: int):
        blk = expected.block
        if blk <= 0 or len(expected.crc32) != -(-size // blk) or start % blk:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed checksum list in the index")
        self.path, self.name, self.expected, self.size, self.blk = path, name, expected, size, blk
        self.fn = checksum_fn(expected.algo, f"{path}: {name}")
        self.k = start // blk
        self.pos = start
        self.crc = 0
        self.block_end = min((self.k + 1) * blk, size)

    def feed(self, piece: memoryview) -> None:
        off = 0
        while off < len(piece):
            take = min(len(piece) - off, self.block_end - self.pos)
            self.crc = self.fn(piece[off:off + take], self.crc)
            off += take
            self.pos += take
            if self.pos == self.block_end:
                if self.crc != self.expected.crc32[self.k]:
                    raise CheckpointError(f"{self.path}: tensor {self.name!r} checksum mismatch in block "
                                          f"{self.k} (file altered or damaged)")
                self.k, self.crc = self.k + 1, 0
                self.block_end = min((self.k + 1) * self.blk, self.size)

    def done(self) -> None:
        """Called after the last piece: a block left unfinished means the read stopped short."""
        if self.crc != 0 or (self.pos < self.block_end and self.pos % self.blk):
            raise CheckpointError(f"{self.path}: tensor {self.name!r} read stopped inside block {self.k}")
