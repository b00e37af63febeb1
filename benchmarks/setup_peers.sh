#!/usr/bin/env bash
# Install the optional peers that benchmarks/vs_peers.py compares zdsl against.
#
# Why a separate script: DeepSpeed is a heavy, optional comparison target, not a
# zdsl dependency, so it stays out of pyproject.toml.  torch DDP and FSDP2 come
# with torch itself and need nothing here.
#
# DeepSpeed runs on CPU with DS_ACCELERATOR=cpu.  Its CPU Adam op is JIT-compiled
# (ninja + a C++ compiler) on first use, about a minute; when that build fails the
# DeepSpeed peer falls back to torch.optim.AdamW as its client optimizer.
set -euo pipefail

PY="${PYTHON:-python}"

# Pin torch to what is installed so pip never swaps the CPU build for another one.
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)')"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"

# ninja builds DeepSpeed's CPU Adam op; py-cpuinfo lets DeepSpeed pick CPU flags.
"$PY" -m pip install --constraint "$CONSTRAINTS" deepspeed ninja py-cpuinfo

DS_ACCELERATOR=cpu "$PY" -c 'import deepspeed; print("deepspeed", deepspeed.__version__, "installed")'
