# pipelines.zs: ZeRO-3 written at the pipelines level.
#
# Policies (zero, offload, prefetch, ...) expand to three templates, one per
# phase, each instantiated for every unit u of the model. Here they are
# written by hand. `zdsl plan --lowered programs/zero3.zs` prints the ones a
# policy file stands for, in this same form.
#
# Rules:
# - statements run in the order written (issue order); each verb runs on its
#   own lane (compute, comm, copies, nvme), so a gather can overlap compute;
# - dependencies are never written: they follow from the buffers each
#   statement reads and writes;
# - parameters[u+1] means "unit u+1's parameters"; indices beyond the model
#   are clipped, and statements that look ahead are also issued for the first
#   units in a prologue.

schedule pipelines "ZeRO-3 with one unit of prefetch, written as pipelines"
model     gpt(layers=2, width=64, heads=4, vocab=256, context=32)
data      corpus("stdlib", context=32)
train     steps=20, batch=4, precision=fp32
optimizer adamw(lr=3e-3, weight_decay=0.1)
ranks     2 on cpu
zero      3                     # which buffers exist: parameter, gradient and optimizer shards
recompute blocks                # which units `recompute u` applies to

forward unit u {
    gather    parameters[u+1]   # all-gather the next unit's shards while this one computes
    compute   u                 # forward of unit u (waits for its own gather)
    free      parameters[u]     # drop the gathered copy; the shard stays
}

backward unit u {               # runs for the last unit first
    gather    parameters[u-1]   # the next unit in backward order
    recompute u                 # re-run forward of u to rebuild its activations
    compute   u                 # backward of unit u: accumulates its full gradient
    free      parameters[u]
    scatter   gradients[u]      # reduce-scatter: each rank keeps its slice
    free      gradients[u+1]    # one unit late, so that scatter overlaps this compute
}

step unit u {
    step      u                 # AdamW on this rank's shard of unit u
}
