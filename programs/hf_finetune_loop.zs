# hf_finetune_loop.zs: the schedule of hf_finetune_loop.py, a Hugging Face fine-tune in your own loop.
#
# The script builds a transformers LlamaForCausalLM itself (from llama/config.json, as
# from_pretrained would from a folder with weights), gives it to zdsl.initialize(model=),
# and computes its own loss from the logits engine(input_ids) returns: a label-smoothed
# cross-entropy, which zdsl run's built-in loss is not. The model statement names the
# same folder, so `zdsl check`, `zdsl plan` and `zdsl run` size and train it too;
# initialize() checks that the object's units are the folder's and trains the object.
# The data: batches() in the script, counting sequences (each token the previous plus
# one; the script cycles through two such batches). Run it with
# `torchrun --nproc-per-node 2 programs/hf_finetune_loop.py`, or on one rank with
# `python programs/hf_finetune_loop.py --ranks 1` (the same as --set ranks=1).

schedule hf_finetune_loop "a transformers Llama fine-tuned in the user's own loop, ZeRO-3"
model     hf("llama")
data      python("hf_finetune_loop.py:batches")
train     steps=12, batch=4, precision=fp32, seed=0
optimizer adamw(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0, clip=1.0)
ranks     2 on cpu
zero      3
prefetch  parameters 1 unit ahead
