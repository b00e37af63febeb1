# written by `zdsl tune` from /work/main/programs/zero3.zs: prefetch=4 bucket=256KiB (predicted 29.74 ms/step)
# zero3.zs: ZeRO stage 3 -- shard everything (FSDP's FULL_SHARD).
#
# Parameters are sharded too: before a unit runs (forward or backward) its
# parameters are all-gathered, and freed right after. Prefetch hides that
# gather behind the compute of the previous unit; small units can stay
# gathered (persist) to save collectives; recompute trades compute for
# activation memory.
# Model states per rank (mixed precision Adam): 16P/N bytes.

schedule zero3 "ZeRO-3 with prefetch, persistence and activation recomputation"
model     gpt(layers=3, width=64, heads=4, vocab=256, context=32)
data      corpus("stdlib", context=32)
train     steps=20, batch=4, precision=fp32
optimizer adamw(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, clip=1.0)
ranks     2 on cpu

zero      3                          # = shard optimizer, gradients, parameters
prefetch 4    # tuned by zdsl tune; was: prefetch  parameters 2 units ahead
persist   below 1000                 # units under 1000 parameters stay gathered (stage3_param_persistence_threshold)
recompute blocks                     # activation checkpointing of every transformer block
memory    device 2GiB                # the plan must fit in 2GiB per rank, or `zdsl check` fails

# set by zdsl tune
bucket 256KiB
