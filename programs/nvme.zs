# nvme.zs: ZeRO-Infinity -- parameters and optimizer state on NVMe.
#
# At stage 3, each rank's parameter shards and optimizer state live in swap
# files under /tmp. Parameters are read from disk one unit ahead of their
# use, copied to the device and gathered; the optimizer state of each unit
# is read, stepped on the CPU, and written back.

schedule nvme "ZeRO-3 with parameters and optimizer state on NVMe (ZeRO-Infinity)"
model     gpt(layers=4, width=256, heads=4, vocab=256, context=32)
data      corpus("stdlib", context=32)
train     steps=10, batch=4, precision=fp32
optimizer adamw(lr=3e-3, weight_decay=0.1)
ranks     2 on cpu

zero      3
# nvme("FOLDER", ...): swap files go in FOLDER; block = I/O size (a multiple
# of 4KiB, for O_DIRECT); depth = requests in flight (DeepSpeed aio queue_depth).
# 1MiB and 8 are DeepSpeed's aio defaults (block_size, queue_depth).
offload   parameters -> nvme("/tmp/zdsl_nvme", block=1MiB, depth=8)
offload   optimizer  -> nvme("/tmp/zdsl_nvme", block=1MiB, depth=8)
prefetch  parameters 1 unit ahead
