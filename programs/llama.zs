# llama.zs: a Hugging Face Llama, trained with ZeRO-3 and the optimizer on the host.
#
# The model comes from a Hugging Face model folder: here programs/llama/, which
# holds only a config.json (4 decoder layers of width 128, byte-level vocab
# of 256). With config.json alone the weights get Hugging Face's own init from
# the schedule's seed; a folder with model.safetensors (say one you saved
# with save_pretrained, or downloaded) is fine-tuned from those weights.
# transformers' own LlamaDecoderLayer runs each layer, so the numbers are
# transformers'. Nothing is downloaded, ever: the folder must be on disk.
#
#     zdsl check programs/llama.zs                    # is it valid? (config checked, no torch)
#     zdsl plan  programs/llama.zs                    # memory, communication, step time
#     zdsl run   programs/llama.zs --export out --format hf
#
# The last line trains, then writes out/ as a Hugging Face folder (config.json
# and model.safetensors under HF's names) that transformers loads back:
#     AutoModelForCausalLM.from_pretrained("out")

schedule llama "a small Hugging Face Llama, ZeRO-3, optimizer on the host"

# The folder is relative to this file. zdsl splits the model into units by
# itself: the token embedding, each decoder layer, and the final norm + head +
# loss, so 6 units here. Settings after the folder override config.json
# fields, by zdsl's names (layers, width, heads) or the config's own, to try
# a schedule on a smaller model: hf("llama", layers=2).
model     hf("llama")

# Python's standard library sources as bytes (vocab 256, as the config says).
# 64 tokens of context; the config allows up to 128 (max_position_embeddings).
data      corpus("stdlib", context=64)

train     steps=20, batch=4, precision=fp32, seed=0
optimizer adamw(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, clip=1.0)
ranks     2 on cpu

# ZeRO-3: every rank keeps half of the parameters, gradients and optimizer
# state; each layer's parameters are gathered just before it runs.
zero      3
prefetch  parameters 1 unit ahead

# The Adam moments and fp32 master weights live in host memory and the step
# runs on the CPU (DeepSpeed's offload_optimizer). On a GPU machine this
# frees 12 bytes per parameter of device memory; on this CPU example the
# schedule and its copies are the same.
offload   optimizer -> cpu(pinned=true)
