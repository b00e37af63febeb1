#!/usr/bin/env bash
# Install the optional peers that benchmarks/vs_peers.py compares zdsl against.
#
# Why a separate script: DeepSpeed is a heavy, optional comparison target, not a
# zdsl dependency, so it stays out of pyproject.toml.  torch DDP and FSDP2 come
# with torch itself and need nothing here.  `vs_peers.py --model hf:llama` also
# needs transformers (zdsl's optional `hf` extra), installed here too.
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
# transformers and tokenizers: the same pins as zdsl's `hf` extra (pyproject.toml).
"$PY" -m pip install --constraint "$CONSTRAINTS" deepspeed ninja py-cpuinfo 'transformers>=5.0' 'tokenizers>=0.22'

DS_ACCELERATOR=cpu "$PY" -c 'import deepspeed; print("deepspeed", deepspeed.__version__, "installed")'
"$PY" -c 'import transformers; print("transformers", transformers.__version__, "installed")'
