"""Sharded checkpoints: atomic per-rank saves, resume at any rank count, export to plain safetensors.

The runtime hands plain host tensors in and gets plain tensors back; see
index.py for the on-disk format.
"""
from .export import export
from .index import (CheckpointError, FileRecord, Index, UnitMeta, checkpoint_path, default_prefix,
                    parse_shard_key, shard_key, state_dict_aliases, unit_prefixes)
from .inspect import inspect
from .reader import (check_checkpoint, iter_rank_shards, latest_complete, list_checkpoints,
                     load_for_rank, read_index)
from .stformat import LazyShard
from .retention import apply_retention, remove_incomplete
from .writer import owned_shard, unit_metas, write_index, write_rank_shards

__all__ = [
    "CheckpointError", "FileRecord", "Index", "LazyShard", "UnitMeta", "apply_retention", "check_checkpoint",
    "checkpoint_path", "default_prefix", "export", "inspect", "iter_rank_shards", "latest_complete",
    "list_checkpoints", "load_for_rank", "owned_shard", "parse_shard_key", "read_index",
    "remove_incomplete", "shard_key", "state_dict_aliases", "unit_metas", "unit_prefixes", "write_index", "write_rank_shards",
]
