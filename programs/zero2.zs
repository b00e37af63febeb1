# zero2.zs: ZeRO stage 2 -- shard optimizer state and gradients.
#
# As stage 1, and each rank also keeps only its slice of the gradients: a
# unit's full gradient lives only from its backward until it has been
# reduce-scattered, then it is freed. Parameters stay whole on every rank.
# Model states per rank (mixed precision Adam): 2P + 14P/N bytes.

schedule zero2 "ZeRO-2: optimizer state and gradients sharded"
model     gpt(layers=2, width=64, heads=4, vocab=256, context=32)
data      corpus("stdlib", context=32)
train     steps=20, batch=4, accumulate=2, precision=fp32
optimizer adamw(lr=3e-3, weight_decay=0.1)
ranks     2 on cpu

shard     optimizer, gradients       # = zero 2; the order is ZeRO's
bucket    256KiB                     # at most 256KiB per reduce-scatter (DeepSpeed reduce_bucket_size)
overlap   scatter/backward           # reduce-scatter unit u+1 while unit u runs backward; nothing else overlaps
