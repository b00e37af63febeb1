"""Whether a schedule's model states fit a device's memory, and the largest model whose would:
the accounting of ZeRO's Table 2 (Rajbhandari et al., 2020) over the compiled graph's own states.

Model states only (parameters, gradients, optimizer state: the graph's persistent buffers on the
tier), not activations or working buffers, so these are upper bounds a run's working memory
lowers. The states grow in proportion to the parameters (each unit's, padded so its shards split
evenly), so the largest model is the budget over the graph's bytes per parameter. Torch-free.
"""
from __future__ import annotations

from zdsl.ir import TaskGraph


def model_state_bytes(graph: TaskGraph, tier: str = "device") -> int:
    """Bytes of model states one rank holds on ``tier``."""
    return sum(b.bytes for b in graph.buffers.values() if b.persistent and b.tier == tier)


def states_fit(graph: TaskGraph, budget: int, tier: str = "device") -> bool:
    """Whether one rank's model states on ``tier`` fit ``budget`` bytes."""
    return model_state_bytes(graph, tier) <= budget


def bytes_per_parameter(graph: TaskGraph, tier: str = "device") -> float:
    """Model-state bytes a rank holds on ``tier`` per parameter of the model."""
    return model_state_bytes(graph, tier) / sum(u.numel for u in graph.units)


def largest_model(graph: TaskGraph, budget: int, tier: str = "device") -> int:
    """The most parameters a model can have whose model states, under this schedule, fit
    ``budget`` bytes per rank on ``tier`` (the graph's bytes per parameter; 0 states: unbounded,
    reported as 0)."""
    per = bytes_per_parameter(graph, tier)
    return int(budget // per) if per > 0 else 0


def largest_model_line(graph: TaskGraph, budget: int) -> str:
    """What the plan says of :func:`largest_model` on the device."""
    per = bytes_per_parameter(graph)
    if per <= 0:
        return "no model states on the device: its budget does not bound the model's size"
    return (f"model states fit the device budget up to {largest_model(graph, budget) / 1e9:,.2f}B parameters "
            f"({per:.3g} B each on the device; working memory aside)")
