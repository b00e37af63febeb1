"""Models as the compiler sees them: an ordered chain of units with sizes.

The built-in GPT is sized analytically here (no torch); a user's model is
sized by the runtime on torch's meta device and handed over as the same
:class:`UnitSpec` list. ``runtime/models/gpt.py`` must build exactly these
parameters, in this order (a test holds the two together).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypedDict

from zdsl.schedule import GPT_DEFAULTS


@dataclass
class UnitSpec:
    name: str
    params: list[tuple[str, tuple[int, ...]]]      # (name within the unit, shape), registration order
    uses: list[int] = field(default_factory=list)  # other units whose parameters this one reads (tied)
    fwd_flops_per_seq: float = 0.0                 # forward flops for one sequence
    act_elems_per_seq: int = 0                     # elements autograd keeps for backward, one sequence
    # the same when the layers run in a 2-byte dtype (bf16, fp16), in 2-byte elements: what they keep
    # in fp32 (a norm's upcast input, the loss's log-probabilities) counts twice; None: act_elems_per_seq
    half_act_elems_per_seq: int | None = None
    input_elems_per_seq: int = 0                   # elements of the unit's input, one sequence
    # the micro-batch's extras (masks, rotary tables: runtime/models/protocol.py's prepare), on unit 0's
    # spec: elements per sequence, and once per micro-batch what every row shares
    extras_elems_per_seq: int = 0
    extras_elems_per_batch: int = 0
    fwd_kernels: int = 0                           # aten ops its forward dispatches (runtime/models/kernel_count.py)
    bwd_kernels: int = 0                           # the same for its backward, gradient accumulation included
    # other names of a parameter (name within the unit -> names): the model's own state-dict name and,
    # for a Hugging Face model, its checkpoint name; globs (freeze, no_decay) match these too
    aliases: dict[str, list[str]] = field(default_factory=dict)

    def act_elems(self, elem_bytes: int) -> int:
        """Elements of ``elem_bytes`` bytes autograd keeps for backward, one sequence, with the
        layers in a dtype of that size."""
        if elem_bytes == 2 and self.half_act_elems_per_seq is not None:
            return self.half_act_elems_per_seq
        return self.act_elems_per_seq

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.params)



# Kernels (aten ops) per unit of runtime/models/gpt.py, forward and backward, counted by
# runtime/models/kernel_count.py (the same for every size; tests/runtime/test_gpt_units.py recounts them).
class Kernels(TypedDict):
    fwd_kernels: int
    bwd_kernels: int


GPT_KERNELS: dict[str, Kernels] = {
    "embedding": Kernels(fwd_kernels=4, bwd_kernels=6),
    "block": Kernels(fwd_kernels=32, bwd_kernels=68),
    "head": Kernels(fwd_kernels=13, bwd_kernels=18),
}


def gpt_units(layers: int, width: int, heads: int, vocab: int, context: int,
              tokens: int | None = None) -> list[UnitSpec]:
    """nanoGPT-class GPT: embedding, ``layers`` pre-LN blocks, head tied to wte.

    ``context`` sizes the position table; ``tokens`` (default: ``context``) is the
    sequence length the run trains on, which sets the flops and activations."""
    d, T, V = width, tokens or context, vocab
    embedding = UnitSpec(
        "embedding",
        [("wte.weight", (V, d)), ("wpe.weight", (context, d))],
        fwd_flops_per_seq=2.0 * T * d,
        act_elems_per_seq=T,                       # the token ids (dropout-free: nothing else kept)
        input_elems_per_seq=T,
        **GPT_KERNELS["embedding"],
    )
    block_params = [
        ("ln_1.weight", (d,)), ("ln_1.bias", (d,)),
        ("attn.c_attn.weight", (3 * d, d)), ("attn.c_attn.bias", (3 * d,)),
        ("attn.c_proj.weight", (d, d)), ("attn.c_proj.bias", (d,)),
        ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
        ("mlp.c_fc.weight", (4 * d, d)), ("mlp.c_fc.bias", (4 * d,)),
        ("mlp.c_proj.weight", (d, 4 * d)), ("mlp.c_proj.bias", (d,)),
    ]
    # 2 flops per multiply-add over 12 d^2 weights, plus causal attention (QK^T and AV, half masked).
    block_flops = 2.0 * T * 12 * d * d + 2.0 * T * T * d
    # Saved for backward (fp elements): ln inputs/outputs, qkv, attention out, mlp in/hidden/gelu.
    block_act = T * d * 19 + heads * T  # sdpa keeps its logsumexp per head and position
    blocks = [
        UnitSpec(f"block.{i}", list(block_params), fwd_flops_per_seq=block_flops,
                 act_elems_per_seq=block_act, input_elems_per_seq=T * d, **GPT_KERNELS["block"],
                 aliases={name: [f"blocks.{i}.{name}"] for name, _ in block_params})   # runtime/models/gpt.py's names
        for i in range(layers)
    ]
    head = UnitSpec(
        "head",
        [("ln_f.weight", (d,)), ("ln_f.bias", (d,))],
        uses=[0],
        fwd_flops_per_seq=2.0 * T * d * V,
        act_elems_per_seq=T * d * 2 + T * V,       # ln_f in/out and the logits for cross-entropy
        # in a 2-byte dtype the loss still runs in fp32 (runtime/models/loss.py): its log-probabilities
        # are kept at 4 bytes, two 2-byte elements each
        half_act_elems_per_seq=T * d * 2 + 2 * T * V,
        input_elems_per_seq=T * d,
        **GPT_KERNELS["head"],
    )
    return [embedding, *blocks, head]


def gpt_parameter_count(**kw) -> int:
    return sum(u.numel for u in gpt_units(**{**GPT_DEFAULTS, **kw}))
