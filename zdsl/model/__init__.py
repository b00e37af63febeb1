"""The model as units, without torch: what the checker, the compiler and the runtime all read.

units (a unit's parameters and activations; the built-in GPT's units, sized analytically),
param_names (a unit's parameter names), layout (a unit's flat buffer over the ranks: parts,
shards, padding), freeze (which parameters ``freeze`` keeps), decay (which ranges take weight
decay), hf_folder (a Hugging Face folder found and its config read).
"""
