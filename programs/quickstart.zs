# quickstart.zs: your first zdsl schedule.
#
# Trains a tiny GPT on two CPU processes (ranks) with ZeRO stage 3: every
# rank keeps only half of the parameters, gradients and optimizer state, and
# gathers each layer's parameters just before it needs them.
#
#     zdsl check programs/quickstart.zs     # is it valid?
#     zdsl plan  programs/quickstart.zs     # memory, communication, step time
#     zdsl run   programs/quickstart.zs     # train it
#
# A '#' starts a comment. There is one statement per line; the first word
# says what the statement sets. grammar/README.md describes every statement.

# A name for the schedule (used in logs and traces) and a one-line description.
schedule quickstart "tiny GPT on 2 CPU ranks, ZeRO-3"

# The model: the built-in GPT with 2 transformer blocks of width 64 and 4
# attention heads, byte-level (vocab 256), 32 tokens of context. zdsl sees it
# as a chain of 4 units: embedding, block 0, block 1, head.
model     gpt(layers=2, width=64, heads=4, vocab=256, context=32)

# The training text: Python's own standard library sources, read as bytes.
data      corpus("stdlib", context=32)

# 30 optimizer steps of 4 sequences per rank, in full fp32 precision.
train     steps=30, batch=4, accumulate=1, precision=fp32, seed=0

# AdamW as in PyTorch; clip=1.0 clips the global gradient norm (as DeepSpeed's
# gradient_clipping).
optimizer adamw(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, clip=1.0)

# Two processes on this machine, each with its own "device" (here the CPU).
ranks     2 on cpu

# ZeRO stage 3: shard optimizer state, gradients and parameters over the
# ranks. Same as `shard optimizer, gradients, parameters`.
zero      3

# While unit u computes, gather the parameters of unit u+1 (DeepSpeed's
# prefetch, FSDP's forward/backward prefetch).
prefetch  parameters 1 unit ahead
