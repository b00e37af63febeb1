# deepspeed_seed.zs: the seeds' DeepSpeed ZeRO-Infinity example, as a schedule.
#
# deepspeed_seed.py, beside this file, is that example's script ported line for
# line: its own SimpleModel, its own data and CrossEntropyLoss, `engine.backward`
# and `engine.step` in its own loop. What DeepSpeed's config dict said is here:
#
#   "zero_optimization": {"stage": 3}          zero 3
#   "offload_param": {"device": "nvme", ...}   offload parameters -> nvme(...)
#   "offload_optimizer": {"device": "nvme"}    offload optimizer  -> nvme(...)
#   "optimizer": {"type": "Adam", lr 0.001}    optimizer adam(lr=1e-3)
#   stage3_param_persistence_threshold 1e6     persist below 1000000 (fc2 stays gathered)
#   stage3_prefetch_bucket_size                prefetch, counted in units
#
# The script gives initialize() its own SimpleModel object: its top-level
# children (fc1, relu, fc2) run in order and become two units, fc1+relu and fc2.
# The model statement names the same model (build() splits a SimpleModel so, its
# CrossEntropyLoss in the last unit), so `zdsl check` and `zdsl plan` size it and
# `zdsl run deepspeed_seed.zs` trains it with zdsl's own loop; initialize() checks
# that the object has the same units and trains the object. The data: `batch=32`
# rows per engine(x) call on each rank, the 32 the example feeds its model, as
# batches() makes them. The example's fp16 section is for GPUs: on CUDA,
# --set precision=fp16 (or bf16); these CPU ranks train in fp32.

schedule deepspeed_seed "the seeds' DeepSpeed example: ZeRO-3, parameters and optimizer on NVMe"
model     "deepspeed_seed.py:build"()
data      python("deepspeed_seed.py:batches")
train     steps=10, batch=32, precision=fp32
optimizer adam(lr=1e-3)
ranks     2 on cpu

zero      3
offload   parameters -> nvme("/tmp/nvme_offload")
offload   optimizer  -> nvme("/tmp/nvme_offload")
prefetch  parameters 1 unit ahead
persist   below 1000000
