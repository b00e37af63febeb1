"""An HF folder's safetensors weights: found, checked against the model, read unit by unit.

``model.safetensors``, or shards listed by ``model.safetensors.index.json``.
A file's header (8-byte length, then JSON: name -> dtype, shape, byte range)
is read without torch, so every tensor's presence and shape, and each file's
length (a truncated download), are checked before anything is loaded, and on
the meta device when the model is sized. Tensors are then read per unit with
``safetensors.safe_open`` (:func:`read_unit`), so no more than one unit is ever read at a time.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from zdsl.model.hf_folder import HfModelError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_files(folder: Path) -> dict[str, Path] | None:
    """Tensor name -> the file holding it; None when the folder has no weights (config only)."""
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HfModelError(f"cannot read {folder / INDEX}: {type(exc).__name__}: {exc}") from None
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / SINGLE).is_file():
        return dict.fromkeys(read_header(folder / SINGLE), folder / SINGLE)
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise HfModelError(f"{folder} holds PyTorch pickles, not safetensors; zdsl reads safetensors only",
                           hint="convert once: AutoModelForCausalLM.from_pretrained(DIR)"
                                ".save_pretrained(DIR, safe_serialization=True)")
    return None


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensors (name -> dtype, shape, data_offsets); checks the file is whole."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise HfModelError(f"{path} is truncated ({len(raw)} bytes): not a safetensors file",
                                   hint="download or save it again")
            (length,) = struct.unpack("<Q", raw)
            size = path.stat().st_size
            if length > size - 8:
                raise HfModelError(f"{path} is truncated: its header alone needs {length + 8} bytes, "
                                   f"the file has {size}", hint="download or save it again")
            header = json.loads(f.read(length))
    except HfModelError:
        raise
    except (OSError, ValueError) as exc:
        raise HfModelError(f"cannot read {path} as safetensors: {type(exc).__name__}: {exc}",
                           hint="download or save it again") from None
    header.pop("__metadata__", None)
    end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if 8 + length + end > size:
        raise HfModelError(f"{path} is truncated: its tensors need {8 + length + end} bytes, the file "
                           f"has {size}", hint="download or save it again")
    return header


def checkpoint_name(files: dict[str, Path], name: str) -> str | None:
    """``name`` as the checkpoint spells it: as is, or without its base model's prefix (GPT-2's
    original files say ``h.0.attn...`` for ``transformer.h.0.attn...``)."""
    if name in files:
        return name
    short = name.partition(".")[2]
    return short if short in files and name.startswith(("transformer.", "model.")) else None


def stored_name(model, u: int, local: str, files: dict[str, Path]) -> str:
    """Unit ``u``'s parameter ``local`` as the checkpoint spells it; HfModelError when it has none."""
    hf = model.hf_name(u, local)
    name = checkpoint_name(files, hf)
    if name is None:
        raise HfModelError(f"the weights have no tensor {hf!r} (unit {u}'s {local})",
                           hint="the config and the weights must come from the same model")
    return name


def check_weights(model, files: dict[str, Path]) -> None:
    """Every parameter of ``model`` is in the files with its shape (headers only)."""
    headers: dict[Path, dict] = {}
    for u, unit in enumerate(model.units()):
        for local, p in unit.named_parameters():
            name = stored_name(model, u, local, files)
            path = files[name]
            if path not in headers:
                if not path.is_file():
                    raise HfModelError(f"{path} is listed in the index but missing")
                headers[path] = read_header(path)
            entry = headers[path].get(name)
            if entry is None:
                raise HfModelError(f"{path} has no tensor {name!r} though the index lists it there")
            if tuple(entry["shape"]) != tuple(p.shape):
                raise HfModelError(f"weight {name!r} in {path.name} has shape {tuple(entry['shape'])} but the "
                                   f"config makes it {tuple(p.shape)}",
                                   hint="the config (and its overrides) must match the weights: drop the "
                                        "overrides that change sizes, or use config.json alone")


def read_unit(model, u: int, files: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Unit ``u``'s tensors from the files by the unit's local parameter names (as stored: the
    model casts them); only this unit's tensors are read."""
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for local, _ in model.units()[u].named_parameters():
        name = stored_name(model, u, local, files)
        by_file.setdefault(files[name], []).append((local, name))
    values = {}
    for path, wanted in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for local, name in wanted:
                values[local] = f.get_tensor(name)
    return values
