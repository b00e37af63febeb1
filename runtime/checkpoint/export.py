"""Consolidating a sharded checkpoint into one plain safetensors state dict.

The result loads with plain torch and safetensors, without zdsl and
without the ranks that wrote it::

    model.load_state_dict(safetensors.torch.load_file("model.safetensors"), strict=True)

Keys are the model's state-dict names: the unit's module prefix from the
index (``embedding``, ``blocks.0``, ``head``) and the parameter's name
within the unit; a tied parameter the model registers twice under each of
its names (the index's ``aliases``, each written as its own tensor); and the
model's persistent buffers, which each rank saves as ``buffer.NAME`` (rank
0's are exported). The header is known from the index before any data is
read, so the file is written unit by unit: host memory holds one unit's
full buffer and one saved shard at a time, whatever the model's size.
A ``model hf(...)`` model can instead go back to a Hugging Face folder
under HF's names (``--format hf``: export_hf.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from zdsl.runtime.checkpoint.errors import CheckpointError
from zdsl.runtime.checkpoint.index import INDEX_NAME, shard_key
from zdsl.runtime.checkpoint.reader import full_unit, latest_complete, open_files, read_index
from zdsl.runtime.checkpoint.stformat import build_header, byte_view, dtype_code, torch_dtype, write_new_file
from zdsl.runtime.io.atomic import renamed_into_place

BUFFER_PREFIX = "buffer."    # a rank file's copy of one of the model's buffers, by its state-dict name
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve(path) -> Path:
    """A checkpoint folder from either itself or a root of ``step-*`` folders (the newest complete)."""
    path = Path(path)
    if (path / INDEX_NAME).exists():
        return path
    found = latest_complete(path, verify=False)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint here (no {INDEX_NAME}, no complete step-* folder)")
    return found


def export_dtype(dtype, unit_dtype: str) -> torch.dtype:
    """The torch dtype an export writes: ``dtype`` (a name, a torch dtype) or, for None, the unit's."""
    if dtype is None:
        return getattr(torch, unit_dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return EXPORT_DTYPES[dtype]
    except KeyError:
        raise CheckpointError(f"export dtype {dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}") from None


def param_entries(unit) -> list[tuple[str, tuple, int, int]]:
    """(name, shape, offset, numel) of each parameter in ``unit``'s (a ``UnitMeta``) flat buffer."""
    out, off = [], 0
    for name, shape in unit.params:
        n = 1
        for s in shape:
            n *= s
        out.append((name, tuple(shape), off, n))
        off += n
    return out


def export(ckpt_path, out_file, dtype="fp32", *, verify: bool = True) -> list[str]:
    """Write checkpoint ``ckpt_path``'s parameters to ``out_file`` (atomically); returns the keys written.

    ``dtype``: ``fp32``, ``bf16``, ``fp16``, a torch dtype, or None for the
    model's own parameter dtype recorded in the index.
    """
    ckpt = resolve(ckpt_path)
    index = read_index(ckpt)
    rec0 = index.file_for_rank(0)
    plan = []           # per unit: list of (key, shape, dtype, offset in the unit's flat buffer)
    specs = []
    for i, unit in enumerate(index.units):
        if shard_key(i, "param") not in rec0.tensors:
            raise CheckpointError(f"{ckpt / rec0.name}: holds no parameters for unit {i} ({shard_key(i, 'param')})")
        out_dtype = export_dtype(dtype, unit.dtype)
        entries = []
        for (_, shape, off, n), key in zip(param_entries(unit), unit.state_dict_keys()):
            keys = [key] + [a for a, src in index.aliases.items() if src == key]
            for k in keys:
                entries.append((k, shape, out_dtype, off, n))
                specs.append((k, dtype_code(out_dtype), tuple(shape)))
        plan.append(entries)
    buffers = []        # (key in rank 0's file, state-dict name, dtype)
    for key, entry in rec0.tensors.items():
        if key.startswith(BUFFER_PREFIX):
            saved = torch_dtype(entry.dtype, key)
            out_dtype = export_dtype(dtype, "") if dtype is not None and saved.is_floating_point else saved
            buffers.append((key, key[len(BUFFER_PREFIX):], out_dtype))
            specs.append((key[len(BUFFER_PREFIX):], dtype_code(out_dtype), tuple(entry.shape)))
    known = {k for k, _, _ in specs}
    dangling = [a for a, src in index.aliases.items() if src not in known]
    if dangling:
        raise CheckpointError(f"{ckpt / INDEX_NAME}: aliases {dangling} point at no parameter")
    header, _ = build_header(specs, {"format": "pt", "zdsl_step": str(index.step)})

    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    files = open_files(ckpt, index)

    def tensors():
        for i, entries in enumerate(plan):
            flat = full_unit(files, index, i, "param", verify)
            cast = {}
            for key, shape, out_dtype, off, n in entries:
                if out_dtype not in cast:
                    cast[out_dtype] = flat if flat.dtype == out_dtype else flat.to(out_dtype)
                yield byte_view(cast[out_dtype][off:off + n])
            del flat, cast
        for key, _, out_dtype in buffers:
            yield byte_view(files[0].read(key, rec0.tensors[key] if verify else None).to(out_dtype))

    try:
        with renamed_into_place(out_file) as tmp:
            write_new_file(str(tmp), header, tensors())
    except OSError as e:
        raise CheckpointError(f"{out_file}: write failed: {e.strerror or e}") from None
    finally:
        files.close()
    return [k for k, _, _ in specs]
