# classifier.zs: DeepSpeed's first example -- your own model on your own data, ZeRO-3 on NVMe.
#
# An MLP sorts float feature vectors into classes with cross-entropy: no
# tokens anywhere. Both the model and the data come from classifier.py, next
# to this file (paths are relative to the schedule):
#
# - the model is built by build(**kwargs), as in user_model.zs;
# - the data is a function, batches(seed, step, micro, rank, world, batch,
#   **settings) -> (inputs, targets): what DeepSpeed is handed as
#   `training_data`. zdsl calls it for every micro-batch of every rank, adds
#   the key=value settings written here, and gives `inputs` to the model's
#   first unit and `targets` to its last. It must be a pure function of its
#   arguments (a generator seeded by them, never the global random state):
#   `zdsl run` calls it twice before any rank starts and stops with the
#   function's name if the two calls differ, return no pair of tensors, or
#   hold other than `batch` rows.
#
# `zdsl check` sizes the model from one row of what the function returns, so
# the plan knows the inputs' shape without a `context`.

schedule classifier "an MLP classifier on float features, ZeRO-3 with parameters and optimizer on NVMe"
model     "classifier.py:build"(features=16, hidden=64, classes=4, layers=2)
data      python("classifier.py:batches", features=16, classes=4)   # features must match the model's
train     steps=30, batch=16, precision=fp32
optimizer adamw(lr=3e-3)
ranks     2 on cpu

zero      3                                  # parameters, gradients and optimizer state sharded
# ZeRO-Infinity (see nvme.zs): each rank's parameter shards and optimizer
# state live in swap files in this folder, read one unit ahead of their use.
offload   parameters -> nvme("/tmp/zdsl_nvme_classifier", block=64KiB, depth=8)
offload   optimizer  -> nvme("/tmp/zdsl_nvme_classifier", block=64KiB, depth=8)
prefetch  parameters 1 unit ahead
