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
# more than a first step's gain, and Adam's first steps (no warm-up: each weight moves by
# about lr, in the gradient's sign) overshoot on wide deep models: lr 3e-6 sent this model's
# loss from 6.0 to 11.4; on 40-layer versions lr 3e-6 was fine at width 512, 1e-6
# overshot at 1024, 5e-7 fell there; so about 5e-7 * 1024 / 2304.
train     steps=3, batch=2, precision=bf16, seed=0
optimizer adamw(lr=2e-7, betas=(0.9, 0.95), weight_decay=0.1, clip=1.0)
ranks     1 on cpu

zero      3
offload   parameters -> nvme("/tmp/zdsl_capacity", block=1MiB, depth=8)
offload   optimizer  -> nvme("/tmp/zdsl_capacity", block=1MiB, depth=8)
prefetch  parameters 1 unit ahead
# The host budget is also the room the compiler fills to move less over NVMe: reading the
# step's optimizer state ahead during the backward, holding the state the next step uses first
# on the host through the whole step, and keeping parameter shards between their forward and
# backward reads (Belady's rule; zdsl plan shows the NVMe bytes saved, benchmarks/nvme_cache.py
# measures them). So it is sized to the machine: 14 GiB of this one's 24, beside the device
# tier's working memory (the CPU device is the same RAM) and the OS; 20 GiB would all be used
# and the plan's fit check refuses that.
memory    host 14GiB
