# pretrain.zs: a pretraining recipe to copy. A small Llama learns Python from
# scratch: real text through a real tokenizer, a held-out validation loss,
# warmup then cosine decay, weight decay on the matrices only, checkpoints.
#
#     zdsl check programs/pretrain.zs
#     zdsl plan  programs/pretrain.zs
#     zdsl run   programs/pretrain.zs --export out/pretrained --format hf
#
# The last line leaves a Hugging Face folder that programs/finetune.zs (or
# transformers' from_pretrained) starts from.

schedule pretrain "a small Llama pretrained on Python's standard library"

# The Llama of programs/llama/config.json (4 layers, width 128), with the
# vocabulary widened to the tokenizer's 4096 ids (zdsl's name `vocab` for the
# config's vocab_size). A folder with weights would be trained on from them.
model     hf("llama", vocab=4096)

# Text through a tokenizer: the standard library's sources ("stdlib": on
# every machine, no download) and programs/tokenizer.json, a byte-level BPE
# that programs/make_tokenizer.py trained on the same text. The first run
# tokenises once into zdsl's cache (a progress bar); later runs start at once.
# Every sample is a 128-token window drawn from the seed, the step and the
# sample's index, so a resumed run continues the same order.
data      text("stdlib", tokenizer="tokenizer.json", context=128)

# 8 sequences a step: 2 ranks x 4. A step is 1024 tokens.
train     steps=200, batch=4, precision=fp32, seed=0

# AdamW as nanoGPT sets it up: warm up linearly for 20 steps to 1e-3, then a
# cosine to a tenth of it by the last step; weight decay 0.1 on matrices, none
# on biases, norms and embeddings (`zdsl plan` counts each group); gradient
# norm clipped at 1.
optimizer adamw(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, clip=1.0, warmup=20, decay=cosine, min_lr=1e-4, no_decay=(biases, norms, embeddings))

ranks     2 on cpu
zero      3
prefetch  parameters 1 unit ahead

# Validation: every 50 steps (and after the last), the mean loss over the
# same 4 batches of text the model never trains on: zdsl's own model code,
# Python outside the standard library. It shows as val_loss in the progress
# line, the summary, --metrics and --tensorboard.
eval      every 50 steps on text("../runtime/models", tokenizer="tokenizer.json") batches=4

# A checkpoint every 100 steps, the newest 2 kept: `zdsl run ... --resume
# out/pretrain` continues where a stopped run left off, on any rank count.
checkpoint every 100 steps -> "out/pretrain" keep 2
