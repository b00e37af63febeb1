"""``zdsl export``: a checkpoint as a plain state dict (export.py) or a Hugging Face folder (export_hf.py)."""
from __future__ import annotations

import argparse
import os
import sys

from zdsl.runtime.checkpoint.errors import CheckpointError
from zdsl.runtime.checkpoint.export import EXPORT_DTYPES, export
from zdsl.runtime.checkpoint.export_hf import DEFAULT_MAX_SHARD_SIZE, FORMATS, export_hf


def main(argv=None) -> int:
    """``zdsl export DIR -o model.safetensors [--dtype bf16]``, or ``-o FOLDER --format hf``."""
    ap = argparse.ArgumentParser(prog="zdsl export", description="consolidate a checkpoint into one safetensors "
                                 "file, or (--format hf) a Hugging Face model folder")
    ap.add_argument("checkpoint", help="a step-* folder, or a checkpoint root (the newest complete one is used)")
    ap.add_argument("-o", "--output", required=True, help="the .safetensors file; with --format hf, a folder")
    ap.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="fp32")
    ap.add_argument("--format", choices=FORMATS, default="plain",
                    help="plain: the model's state dict (default); hf: a folder from_pretrained loads "
                         "(`model hf(...)` models)")
    ap.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
                    help="--format hf: split the weights into files of at most SIZE "
                         f"(default {DEFAULT_MAX_SHARD_SIZE})")
    args = ap.parse_args(argv)
    try:
        if args.format == "hf":
            files = export_hf(args.checkpoint, args.output, args.dtype, max_shard_size=args.max_shard_size)
            print(f"wrote {args.output}: {', '.join(files)} ({args.dtype})")
            return 0
        keys = export(args.checkpoint, args.output, args.dtype)
    except CheckpointError as e:
        print(f"zdsl export: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(keys)} tensors to {args.output} ({os.path.getsize(args.output)} bytes, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
