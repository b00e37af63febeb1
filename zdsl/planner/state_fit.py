"""Whether a schedule's model states fit a device's memory, and the largest model whose would:
the accounting of ZeRO's Table 2 (Rajbhandari et al., 2020) over the compiled graph's own states;
and the deepest GPT whose whole planned peak fits (:func:`largest_gpt`).

The first part counts model states only (parameters, gradients, optimizer state: the graph's
persistent buffers on the tier), not activations or working buffers, so its figures are upper
bounds a run's working memory lowers. The states grow in proportion to the parameters (each
unit's, padded so its shards split evenly), so the largest model is the budget over the graph's
bytes per parameter. :func:`largest_gpt` counts everything ``zdsl plan``'s peak does. Torch-free.
"""
from __future__ import annotations

from collections.abc import Callable

from zdsl.check.checker import check_text
from zdsl.driver import compile_schedule
from zdsl.ir import TaskGraph
from zdsl.model.units import gpt_units
from zdsl.sim.simulate import simulate


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


def plan_peak(graph: TaskGraph, tier: str = "device") -> int:
    """The peak ``zdsl plan`` reports for ``tier``: model states plus the simulated step's working
    peak (activations, gathered units, gradients before they leave, buckets and staging copies),
    on the graph's own machine profile (the schedule's ``machine``, else the defaults)."""
    return simulate(graph).memory.peak(tier)


def largest_depth(peak_at: Callable[[int], int], budget: int, most: int = 1 << 16) -> int:
    """The most layers ``n`` in 1..``most`` with ``peak_at(n) <= budget``, 0 when one layer is over.

    ``peak_at`` must not decrease with ``n`` (a deeper model holds at least what a shallower one
    does), which makes a doubling search then a bisection exact: about 2 log2(n) probes."""
    if peak_at(1) > budget:
        return 0
    fits, over = 1, 2
    while over <= most and peak_at(over) <= budget:
        fits, over = over, over * 2
    over = min(over, most + 1)
    while over - fits > 1:
        mid = (fits + over) // 2
        if peak_at(mid) <= budget:
            fits = mid
        else:
            over = mid
    return fits


def largest_gpt(schedule_text: str, shape: dict[str, int], budget: int,
                tier: str = "device") -> tuple[int, int]:
    """(layers, parameters) of the deepest built-in GPT of ``shape`` (its width, heads, vocab and
    context; its ``layers`` is what varies) whose plan peak on ``tier`` fits ``budget`` bytes under
    ``schedule_text`` (a schedule without its ``model`` statement); (0, 0) when none does. One
    compile and simulation per probe; a schedule with errors raises the checker's ``ZsError``."""
    def graph(layers: int) -> TaskGraph:
        sized = {**shape, "layers": layers}
        model = "model gpt(" + ", ".join(f"{k}={v}" for k, v in sized.items()) + ")\n"
        schedule, _ = check_text(model + schedule_text, "largest_gpt.zs")
        return compile_schedule(schedule, gpt_units(**sized))

    layers = largest_depth(lambda n: plan_peak(graph(n), tier), budget)
    return layers, (sum(u.numel for u in graph(layers).units) if layers else 0)
