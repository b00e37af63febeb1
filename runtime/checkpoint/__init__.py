"""Sharded checkpoints: atomic per-rank saves, resume at any rank count, export to plain safetensors.

The runtime hands plain host tensors in and gets plain tensors back; no
torch.distributed inside. See index.py for the on-disk format. The flow:

Save (every rank, from an I/O thread, after copying its shards to host)::

    rec = write_rank_shards(root, step, rank, ranks, {"u0.param": ..., "u0.exp_avg": ...,
                            "rng.cpu": torch.get_rng_state()}, tag=run_id)
    # rank 0 only, once its own file is written (waits for the others' done markers):
    metas = unit_metas(unit_specs, layouts, unit_prefixes(model))
    write_index(root, step, {"units": metas, "schedule_hash": ..., "data_position": {...},
                             "loss_scaler": {...} or None, "aliases": state_dict_aliases(model, metas),
                             "extra": {"optimizer_steps": n}}, [rec], tag=run_id)
    apply_retention(root, keep)

Resume (every rank)::

    path = latest_complete(root, verify=False)        # cheap: index, sizes, headers
    index = read_index(path)                          # step, data position, scaler, extra
    shards = load_for_rank(path, rank, ranks, layouts)  # re-cut; every byte read is CRC-checked

Export: ``export(root_or_path, "model.safetensors", "bf16")``; ``inspect(root)``.
"""
from zdsl.runtime.checkpoint.errors import CheckpointError
from zdsl.runtime.checkpoint.export import export
from zdsl.runtime.checkpoint.index import (
                    FileRecord,
                    Index,
                    UnitMeta,
                    checkpoint_path,
                    default_prefix,
                    parse_shard_key,
                    shard_key,
                    state_dict_aliases,
                    unit_prefixes,
)
from zdsl.runtime.checkpoint.inspect import inspect
from zdsl.runtime.checkpoint.reader import (
                    check_checkpoint,
                    iter_rank_shards,
                    latest_complete,
                    list_checkpoints,
                    load_for_rank,
                    read_index,
)
from zdsl.runtime.checkpoint.retention import apply_retention, remove_incomplete
from zdsl.runtime.checkpoint.stformat import LazyShard
from zdsl.runtime.checkpoint.writer import owned_shard, unit_metas, write_index, write_rank_shards

__all__ = [
    "CheckpointError", "FileRecord", "Index", "LazyShard", "UnitMeta", "apply_retention", "check_checkpoint",
    "checkpoint_path", "default_prefix", "export", "inspect", "iter_rank_shards", "latest_complete",
    "list_checkpoints", "load_for_rank", "owned_shard", "parse_shard_key", "read_index",
    "remove_incomplete", "shard_key", "state_dict_aliases", "unit_metas", "unit_prefixes", "write_index",
    "write_rank_shards",
]
