# finetune.zs: a supervised fine-tuning recipe to copy. The model learns to
# answer questions: prompt/response records from a JSON-lines file, the loss
# on the responses only, short records packed together without seeing each
# other.
#
#     zdsl run programs/pretrain.zs --export out/pretrained --format hf
#     zdsl run programs/finetune.zs --set 'model=hf("out/pretrained")' --export out/finetuned --format hf
#
# As written it starts from config.json's seeded init, so it runs on a
# fresh clone; the --set line above starts from the pretrained weights.

schedule finetune "supervised fine-tuning of a small Llama on question/answer records"

# Relative paths are from this file: --set model=hf("...") from the shell's
# folder. A folder with model.safetensors is loaded unit by unit, each rank
# reading only what it keeps.
model     hf("llama", vocab=4096)

# programs/data/sft.jsonl: 200 records like
#   {"prompt": "Question: What is 23 + 55?\nAnswer:", "response": " 78"}
# (other field names: prompt="...", response="..."). Each becomes prompt +
# response + end of text; labels on the prompt are -100
# (not counted), so the loss is over the answers. pack=true puts several
# records in a 64-token row, each attending only to itself with positions
# from 0 (the same loss and gradients as a row each, less padding).
data      jsonl("data/sft.jsonl", tokenizer="tokenizer.json", pack=true, context=64)

train     steps=60, batch=4, precision=fp32, seed=0

# A smaller rate than pretraining, a short warmup, then linear decay to zero.
optimizer adamw(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, clip=1.0, warmup=6, decay=linear, min_lr=0)

# Fine-tune the layers, keep the token embedding as pretraining left it: no
# gradient, no optimizer state and no gradient traffic for it (`zdsl plan`
# shows what that saves).
freeze    embed_tokens.weight

ranks     2 on cpu
zero      3
prefetch  parameters 1 unit ahead
