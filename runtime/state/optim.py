"""The sharded optimizer: torch's own AdamW, Adam and SGD over a rank's flat shard.

Each unit has one :class:`UnitOptimizer`. Its state lives in one flat fp32
buffer (the ``optim[u]`` buffer of the task graph) laid out as segments of
the shard's length: the fp32 master copy first (mixed precision, or when the
step runs away from the parameters), then the optimizer's moments (AdamW and
Adam: ``exp_avg``, ``exp_avg_sq``; SGD with momentum: ``momentum_buffer``).
One flat buffer is what moves between tiers (host, NVMe) in one copy.

The update itself is torch.optim's: a torch optimizer over one Parameter per
bucket part, whose ``.data``, ``.grad`` and state tensors are pointed at the
right slices before each step. The updates are elementwise, so applying them
to a shard gives, element for element, the bits plain data parallel training
gets with the same torch optimizer over whole parameters (checked against
DDP by the tests), with the same ``foreach``/``fused`` settings.

On the CPU, AdamW and Adam (without ``foreach``/``fused`` asked for) run
through ``runtime/offload/host_adam.py``'s single-pass kernel, which is checked at
load to give torch's single-tensor bits (about 2.5x faster than torch's
seven kernels); the step count stays in the torch optimizer's state.

The rate is set before every step from the schedule's formula (``set_lr``,
zdsl/lr.py). Weight decay applies where the task graph says (``UnitInfo.decay``,
zdsl/model/decay.py): the shard is cut at the edges of those ranges into
pieces, one Parameter each, in two param groups (decay and ``weight_decay=0``),
which gives the bits of a torch optimizer with the same two groups over whole
parameters. Frozen parameters (``UnitInfo.frozen``) are cut out the same way and get no piece:
the torch optimizer never sees them, so they keep their values whatever the weight decay. A
unit with nothing to train has no optimizer at all (``numel`` 0).

Gradient clipping follows ``torch.nn.utils.clip_grad_norm_``: coefficient
``max_norm / (total_norm + 1e-6)`` clamped at 1, multiplied into the
gradients before the step.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from zdsl.runtime.offload.host_adam import host_adamw_

MOMENTS = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq")}


def state_names(kind: str, momentum: float = 0.0) -> tuple[str, ...]:
    if kind in MOMENTS:
        return MOMENTS[kind]
    if kind == "sgd":
        return ("momentum_buffer",) if momentum else ()
    raise ValueError(f"unknown optimizer {kind!r} (expected adamw, adam or sgd)")


# torch wraps these Optimizer methods in torch._disable_dynamo, whose first call imports
# torch._dynamo (about 2 s of a rank's start on a slow core, a third of a small run's) only so
# that torch.compile does not trace them. zdsl calls its optimizers outside any compiled code:
# its classes call the methods unwrapped (functools' ``__wrapped__``). ``step`` still imports
# torch._dynamo where torch's own update runs (SGD, foreach, fused); the host AdamW does not.
_UNWRAPPED = {name: getattr(torch.optim.Optimizer, name).__wrapped__
              for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
              if hasattr(getattr(torch.optim.Optimizer, name), "__wrapped__")}
_CLASSES = {kind: type(cls.__name__, (cls,), {**_UNWRAPPED, "__module__": cls.__module__})
            for kind, cls in (("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam), ("sgd", torch.optim.SGD))}


def make_torch_optimizer(params, config: dict) -> torch.optim.Optimizer:
    """The torch optimizer a schedule's ``optimizer`` statement names (also used by the DDP
    reference): an instance of torch's class (a subclass of it without the import above)."""
    kind = config.get("kind", "adamw")
    common = {k: config[k] for k in ("foreach", "fused") if config.get(k) is not None}
    lr = config.get("lr", 1e-3)
    wd = config.get("weight_decay", 0.0)
    if kind in ("adamw", "adam"):
        return _CLASSES[kind](params, lr=lr, betas=tuple(config.get("betas", (0.9, 0.999))),
                              eps=config.get("eps", 1e-8), weight_decay=wd, **common)
    if kind == "sgd":
        return _CLASSES[kind](params, lr=lr, momentum=config.get("momentum", 0.0), weight_decay=wd, **common)
    raise ValueError(f"unknown optimizer {kind!r} (expected adamw, adam or sgd)")


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_'s coefficient, computed the same way (fp32 tensor ops)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def segment_decay(decay, layout, rank: int, whole: bool) -> list[tuple[int, int]] | None:
    """A unit's decaying ranges (``UnitInfo.decay``: elements of its full flat buffer), or any
    other element ranges of it (its frozen ones), as ranges of its optimizer segment: the full
    buffer itself when ``whole`` (stage 0), else the rank's shard (its slice of every part, in
    order). None stays None (all decay)."""
    if decay is None:
        return None
    if whole:
        return [(a, b) for a, b in decay]
    out = []
    for p, (a, b) in enumerate(layout.owned_full_ranges(rank)):
        base = layout.shard_range(p)[0]
        out += [(max(lo, a) - a + base, min(hi, b) - a + base) for lo, hi in decay if max(lo, a) < min(hi, b)]
    return out


def _pieces(part_ranges, decay, frozen=()) -> list[tuple[int, int, int, bool]]:
    """(part, start, end within the part, decays) of every piece a part is cut into; none
    for ``frozen`` ranges."""
    if decay is None and not frozen:
        return [(i, 0, b - a, True) for i, (a, b) in enumerate(part_ranges)]
    out = []
    cuts = [*(decay or ()), *frozen]
    for i, (a, b) in enumerate(part_ranges):
        edges = sorted({a, b, *(x for r in cuts for x in r if a < x < b)})
        for lo, hi in zip(edges, edges[1:]):
            if any(r0 <= lo and hi <= r1 for r0, r1 in frozen):
                continue
            decays = decay is None or any(r0 <= lo and hi <= r1 for r0, r1 in decay)
            out.append((i, lo - a, hi - a, decays))
    return out


class UnitOptimizer:
    """torch.optim over the flat shard of one unit (one Parameter per piece of a bucket part).

    ``part_ranges``: the (start, end) elements of each part within a segment
    (the shard's part slices; at stage 0 the full buffer's parts). ``decay``:
    the segment's ranges weight decay applies to (``segment_decay``), None for all.
    ``frozen``: the segment's ranges that never change (frozen parameters). No ranges: a unit
    that does not train, with no optimizer state.
    """

    def __init__(self, config: dict, part_ranges: list[tuple[int, int]], master: bool,
                 decay: list[tuple[int, int]] | None = None, frozen: list[tuple[int, int]] | None = None):
        self.config = config
        self.kind = config.get("kind", "adamw")
        self.names = state_names(self.kind, config.get("momentum", 0.0))
        self.master = master
        self.ranges = part_ranges
        self.numel = part_ranges[-1][1] if part_ranges else 0
        self.pieces = _pieces(part_ranges, decay, frozen or ())
        self.params = [nn.Parameter(torch.zeros(hi - lo)) for _, lo, hi, _ in self.pieces]
        if not self.params:
            self.opt = None
        elif decay is None:
            self.opt = make_torch_optimizer(self.params, config)
        else:
            groups = [{"params": [p for p, piece in zip(self.params, self.pieces) if piece[3] == want],
                       "weight_decay": config.get("weight_decay", 0.0) if want else 0.0}
                      for want in (True, False)]
            self.opt = make_torch_optimizer([g for g in groups if g["params"]], config)
        self._group = {id(p): g for g in self.opt.param_groups for p in g["params"]} if self.opt else {}
        self.fast_adam = self.kind in MOMENTS and not config.get("foreach") and not config.get("fused")
        self.device_step = self.kind in MOMENTS and bool(config.get("fused") or config.get("capturable"))
        self._plain_steps = 0   # SGD keeps no step count of its own
        if self.opt is not None:
            for p in self.params:   # our state slices replace torch's lazy init (filled in bind)
                self.opt.state[p] = {"step": torch.tensor(0.0)} if self.kind in MOMENTS else {}

    @property
    def trains(self) -> bool:
        """It updates something (a unit whose parameters are all frozen has nothing to update)."""
        return bool(self.params)

    @property
    def segments(self) -> int:
        return len(self.names) + (1 if self.master else 0)

    @property
    def flat_numel(self) -> int:
        return self.segments * self.numel

    @property
    def steps(self) -> int:
        """Optimizer steps taken (AdamW/Adam keep it in their state; SGD does not need it)."""
        if self.kind in MOMENTS and self.opt is not None:     # an optimizer exactly when there are params
            return int(self.opt.state[self.params[0]]["step"].item())
        return self._plain_steps

    def restore_steps(self, steps: int) -> None:
        """Continue counting from ``steps`` (a loaded checkpoint's), as the optimizer would have."""
        if self.opt is not None:
            for p in self.params:
                if "step" in self.opt.state[p]:
                    self.opt.state[p]["step"] = torch.tensor(float(steps))
        self._plain_steps = steps

    def set_lr(self, lr: float) -> None:
        """The rate of the coming step (every group: the schedule scales one rate)."""
        for group in (self.opt.param_groups if self.opt else ()):
            group["lr"] = lr

    def master_parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[a:b] for a, b in self.ranges]

    def _segment_pieces(self, flat: torch.Tensor, k: int) -> list[torch.Tensor]:
        base = k * self.numel
        return [flat[base + self.ranges[i][0] + lo:base + self.ranges[i][0] + hi] for i, lo, hi, _ in self.pieces]

    def step(self, flat: torch.Tensor, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """One update. ``params``: the parts to update (the master parts when ``master``),
        fp32, contiguous; ``grads``: fp32 gradients, already unscaled and clipped."""
        opt = self.opt
        if opt is None:     # this rank's shard holds only frozen elements
            self._plain_steps += 1
            return
        first = 1 if self.master else 0
        moments = [self._segment_pieces(flat, first + k) for k in range(len(self.names))]
        params = [params[i][lo:hi] for i, lo, hi, _ in self.pieces]
        grads = [grads[i][lo:hi] for i, lo, hi, _ in self.pieces]
        if self.fast_adam and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                                  for t in (*params, *grads, *moments[0], *moments[1])):
            self._host_adam(opt, params, grads, moments)
            self._plain_steps += 1
            return
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.data = params[i]
                p.grad = grads[i]
                state = opt.state[p]
                for k, name in enumerate(self.names):
                    state[name] = moments[k][i]
                if self.device_step and "step" in state and state["step"].device != params[i].device:
                    # fused (and capturable) Adam read the count through a device pointer: torch
                    # keeps it on the parameter's device for them (as its own lazy state init does)
                    state["step"] = state["step"].to(params[i].device)
            opt.step()
        self._plain_steps += 1
        for p in self.params:   # drop the references so freed buffers are really freed
            p.grad = None
            p.data = torch.empty(0)

    def _host_adam(self, opt: torch.optim.Optimizer, params, grads, moments) -> None:
        for i, p in enumerate(self.params):
            group = self._group[id(p)]
            b1, b2 = group["betas"]
            state = opt.state[p]
            state["step"] += 1
            host_adamw_(params[i], grads[i], moments[0][i], moments[1][i], int(state["step"].item()),
                        group["lr"], b1, b2, group["eps"], group["weight_decay"], adam_w=self.kind == "adamw",
                        threads=torch.get_num_threads())
