# zero1.zs: ZeRO stage 1 -- shard only the optimizer state.
#
# Each rank keeps the full parameters and full gradients (as plain data
# parallelism, DDP) but only its 1/N slice of the Adam moments (and of the
# fp32 master weights under mixed precision). After backward, gradients are
# reduce-scattered; each rank updates its slice; the updated slices are
# all-gathered back into the full parameters.
# Model states per rank (mixed precision Adam): 2P + 2P + 12P/N bytes.

schedule zero1 "ZeRO-1: optimizer state sharded over 2 ranks"
model     gpt(layers=2, width=64, heads=4, vocab=256, context=32)
data      corpus("stdlib", context=32)
train     steps=20, batch=4, precision=fp32
optimizer adamw(lr=3e-3, weight_decay=0.1)
ranks     2 on cpu

shard     optimizer                  # = zero 1 (DeepSpeed "stage": 1)
