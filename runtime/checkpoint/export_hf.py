"""Exporting a ``model hf(...)`` model back to a Hugging Face folder.

The folder loads with ``AutoModelForCausalLM.from_pretrained(DIR)``, no key
missing or unexpected: ``config.json`` (the config as trained, overrides
applied, ``dtype`` the export's, ``architectures`` set), the weights under
HF's names in ``model.safetensors`` or, above ``max_shard_size``, in
``model-0000i-of-0000n.safetensors`` shards listed by
``model.safetensors.index.json`` (``weight_map``, ``metadata.total_size``),
and the source folder's tokenizer and generation files when it has them. A
tied embedding is written once, under the name HF keeps (the embedding's).

From a checkpoint (:func:`export_hf`) the model's spec comes from the index
(``extra["model"]``, recorded at save time); the HF names come from that
model built on the meta device, so nothing is allocated for it, and the
tensors are written unit by unit as the plain export does. From a run
(:func:`convert_state_dict`) a plain state-dict file is converted tensor by
tensor.
"""
from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from zdsl.model.hf_folder import HfModelError
from zdsl.runtime.checkpoint.errors import CheckpointError
from zdsl.runtime.checkpoint.export import export_dtype, param_entries, resolve
from zdsl.runtime.checkpoint.index import unit_prefixes
from zdsl.runtime.checkpoint.reader import full_unit, open_files, read_index
from zdsl.runtime.checkpoint.stformat import _nbytes as tensor_bytes
from zdsl.runtime.checkpoint.stformat import build_header, byte_view, dtype_code, write_new_file
from zdsl.runtime.checkpoint.writer import write_atomic
from zdsl.runtime.io.atomic import renamed_into_place
from zdsl.runtime.models.hf import load
from zdsl.schedule import ModelSpec

FORMATS = ("plain", "hf")
DEFAULT_MAX_SHARD_SIZE = "5GB"          # transformers' save_pretrained default
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text) -> int:
    """Bytes in ``5GB``, ``500MiB``, ``4096`` (as transformers spells sizes: GB = 10**9)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
    if m is None or float(m.group(1)) <= 0:
        raise CheckpointError(f"max shard size {text!r}: expected a positive size such as 5GB, 500MB or 1000000")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def not_hf_error(kind: str) -> CheckpointError:
    return CheckpointError(f"--format hf applies to `model hf(...)` models; this one is `model {kind}(...)`: "
                           f"export it without --format hf (a plain state dict)")


def hf_model_on_meta(model_spec: dict):
    """The ``model hf`` that ``model_spec`` (a ``ModelSpec`` as JSON) names, sized on the meta device."""
    if model_spec.get("kind") != "hf":
        raise not_hf_error(str(model_spec.get("kind")))
    try:
        with torch.device("meta"):
            return load(ModelSpec(**model_spec))
    except HfModelError as exc:
        hint = f" ({exc.hint})" if getattr(exc, "hint", None) else ""
        raise CheckpointError(f"the export reads the model's config from its source folder, "
                              f"{model_spec.get('path')}: {exc}{hint}") from None


def hf_config(model, dtype: torch.dtype):
    """The model's transformers config as trained, for ``config.json``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return config


def hf_names_by_key(model) -> dict[str, str]:
    """The model's state-dict name of every unit parameter -> its HF name."""
    out = {}
    for u, (prefix, unit) in enumerate(zip(unit_prefixes(model), model.units())):
        for local, _ in unit.named_parameters():
            out[f"{prefix}.{local}" if prefix else local] = model.hf_name(u, local)
    return out


def plan_shards(specs: list[tuple[str, str, tuple]], max_bytes: int) -> list[list[int]]:
    """Tensors (indices into ``specs``, in order) per file: a new file when the next tensor would
    take this one past ``max_bytes`` (a tensor larger than that gets a file of its own)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, code, shape) in enumerate(specs):
        n = tensor_bytes(code, shape)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards


def write_hf_folder(out_dir, config, specs: list[tuple[str, str, tuple]], tensors: Iterable[memoryview],
                    max_shard_size=DEFAULT_MAX_SHARD_SIZE, source=None, metadata: dict | None = None) -> list[str]:
    """Write an HF folder: ``config``, the ``specs`` (HF name, dtype code, shape) whose bytes
    ``tensors`` yields in the same order, and ``source``'s tokenizer files. Returns the files written."""
    out = Path(out_dir)
    shards = plan_shards(specs, parse_size(max_shard_size))
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a folder (--format hf writes a folder)")
    out.mkdir(parents=True, exist_ok=True)
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    stream: Iterator[memoryview] = iter(tensors)
    meta = {"format": "pt", **(metadata or {})}
    written = []
    try:
        for name, members in zip(names, shards):
            header, _ = build_header([specs[i] for i in members], meta)
            with renamed_into_place(out / name) as tmp:
                write_new_file(str(tmp), header, (next(stream) for _ in members))
            written.append(name)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(tensor_bytes(c, s) for _, c, s in specs)},
                     "weight_map": {specs[i][0]: name for name, members in zip(names, shards) for i in members}}
            write_atomic(out / INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
            written.append(INDEX)
        write_atomic(out / "config.json", config.to_json_string(use_diff=True).encode())
        written.append("config.json")
        for name in COPIED:
            if source is not None and (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, out / name)
                written.append(name)
    except OSError as e:
        raise CheckpointError(f"{out}: write failed: {e.strerror or e}") from None
    for stale in out.iterdir():       # an earlier export's weights here would be read beside ours
        if (stale.name in (SINGLE, INDEX) or SHARD_RE.fullmatch(stale.name)) and stale.name not in written:
            stale.unlink()
    return written


def export_hf(ckpt_path, out_dir, dtype="fp32", *, max_shard_size=DEFAULT_MAX_SHARD_SIZE,
              verify: bool = True) -> list[str]:
    """Write checkpoint ``ckpt_path``'s model as an HF folder ``out_dir``; returns the files written."""
    ckpt = resolve(ckpt_path)
    index = read_index(ckpt)
    spec = index.extra.get("model")
    if spec is None:
        raise CheckpointError(f"{ckpt}: the checkpoint does not record its model (saved by an older zdsl); "
                              f"export it without --format hf, or save it again by resuming and training a step")
    model = hf_model_on_meta(spec)
    units = model.units()
    if len(units) != len(index.units):
        raise CheckpointError(f"{ckpt}: holds {len(index.units)} units but {spec['path']} makes "
                              f"{len(units)}: the model folder changed since the checkpoint was saved")
    out_dtype = export_dtype(dtype, "float32")
    specs, plan = [], []
    for u, (unit, meta) in enumerate(zip(units, index.units)):
        mine = [(n, tuple(p.shape)) for n, p in unit.named_parameters()]
        if mine != [(n, tuple(s)) for n, s in meta.params]:
            raise CheckpointError(f"{ckpt}: unit {u}'s parameters differ from those {spec['path']} makes: "
                                  f"the model folder changed since the checkpoint was saved")
        entries = param_entries(meta)
        plan.append(entries)
        specs += [(model.hf_name(u, name), dtype_code(out_dtype), shape) for name, shape, _, _ in entries]
    files = open_files(ckpt, index)

    def tensors():
        for u, entries in enumerate(plan):
            flat = full_unit(files, index, u, "param", verify).to(out_dtype)
            for _, _, off, n in entries:
                yield byte_view(flat[off:off + n])
            del flat

    try:
        return write_hf_folder(out_dir, hf_config(model, out_dtype), specs, tensors(), max_shard_size,
                               spec["path"], {"zdsl_step": str(index.step)})
    finally:
        files.close()


def convert_state_dict(state_file, model_spec: dict, out_dir, dtype="fp32", *,
                       max_shard_size=DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """An HF folder from a plain state-dict file of the ``model hf`` ``model_spec`` names (what
    ``zdsl run --export`` writes), read tensor by tensor."""
    model = hf_model_on_meta(model_spec)
    names = hf_names_by_key(model)
    out_dtype = export_dtype(dtype, "float32")
    with safe_open(str(state_file), framework="pt") as f:
        lacking = sorted(set(names) - set(f.keys()))
        if lacking:
            raise CheckpointError(f"{state_file}: lacks the model's {', '.join(lacking[:5])}")
        specs = [(hf, dtype_code(out_dtype), tuple(f.get_slice(key).get_shape())) for key, hf in names.items()]
        tensors = (byte_view(f.get_tensor(key).to(out_dtype).contiguous()) for key in names)
        return write_hf_folder(out_dir, hf_config(model, out_dtype), specs, tensors, max_shard_size,
                               model_spec["path"])
