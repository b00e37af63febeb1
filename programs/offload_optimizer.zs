# offload_optimizer.zs: ZeRO-Offload -- optimizer state and step in host memory.
#
# The Adam moments (and fp32 master weights) live in host memory and the
# optimizer step runs on the CPU; gradients are copied to the host after
# their reduce-scatter and the updated parameters are copied back. On a GPU
# machine this frees 12 bytes per parameter of device memory; on this CPU
# example "host" and "device" are the same memory, but the schedule and its
# copies are the same as on a GPU.

schedule offload_optimizer "ZeRO-2 with the optimizer offloaded to the host (ZeRO-Offload)"
model     gpt(layers=2, width=64, heads=4, vocab=256, context=32)
data      corpus("stdlib", context=32)
train     steps=20, batch=4, precision=fp32
optimizer adamw(lr=3e-3, weight_decay=0.1)
ranks     2 on cpu

zero      2
offload   optimizer -> cpu(pinned=true)   # DeepSpeed offload_optimizer: {device: cpu, pin_memory: true}
memory    host 4GiB
