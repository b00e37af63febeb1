# capacity.zs: a model whose training state does not fit in this machine's RAM (ZeRO-Infinity).
#
# GPT with 40 layers of width 2304: 2.55e9 parameters, so 16 bytes per
# parameter of mixed-precision model states = 40.8 GB, more than 1.5x the
# 24 GiB of RAM here. ZeRO-3 with the bf16 parameter shards and the fp32
# optimizer state (master weights and Adam moments, 12 bytes per parameter)
# in swap files on NVMe: host memory holds the bf16 gradient shards, one or
# two gathered units, and the optimizer state of the units being stepped.
# The model is built unit by unit (runtime/models/gpt.py: models this large
# initialise lazily), so start-up never holds the whole model either.
# Run by benchmarks/capacity.py (which also measures peak RSS and NVMe bytes).

schedule capacity "2.5e9-parameter GPT on one CPU rank, parameters and optimizer on NVMe"
model     gpt(layers=40, width=2304, heads=18, vocab=256, context=64)
data      corpus("stdlib", context=64)
# batch 2 and a small lr: with batch 1 the loss of consecutive 64-token batches varies by
# more than a first step's gain, and Adam's first steps at lr >= 1e-5 (no warm-up)
# overshoot at this width (measured on 2-layer versions of this model).
train     steps=3, batch=2, precision=bf16, seed=0
optimizer adamw(lr=3e-6, betas=(0.9, 0.95), weight_decay=0.1, clip=1.0)
ranks     1 on cpu

zero      3
offload   parameters -> nvme("/tmp/zdsl_capacity", block=1MiB, depth=8)
offload   optimizer  -> nvme("/tmp/zdsl_capacity", block=1MiB, depth=8)
prefetch  parameters 1 unit ahead
memory    host 20GiB
