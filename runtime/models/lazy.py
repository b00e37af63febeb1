"""Models whose units get their values one at a time: what lets a model larger than a rank's memory
start (the built-in GPT above a size, every Hugging Face model under ``zdsl run``).

Contract with ``RankState`` (runtime/state/rank.py): while :attr:`is_lazy`, it calls
:meth:`materialize_unit` for units 0, 1, ... in that order, copies each into its flat buffers and
tiers, and drops it before the next, so start-up holds one unit's full parameters at a time.
Parameter objects are never replaced (values are swapped into them), so every reference to them
(a tied head's, an optimizer's) stays valid. A model mixes this in and calls :meth:`defer` with a
source of unit values, ``values(u) -> {local parameter name: tensor}``, which may draw from one
generator (a seeded init) because units come in order.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

UnitValues = Callable[[int], dict[str, torch.Tensor]]


class LazyUnits(nn.Module):
    """The base of a module whose ``units()`` may get their values later."""

    _pending: dict | None = None      # while units wait: {"values": UnitValues, "next": unit}

    def units(self) -> list[nn.Module]:
        raise NotImplementedError(f"{type(self).__name__} lists no units()")

    def defer(self, values: UnitValues) -> None:
        """Units get their values from ``values(u)`` when :meth:`materialize_unit` asks, in order."""
        self._pending = {"values": values, "next": 0}

    @property
    def is_lazy(self) -> bool:
        """Whether some units still wait for :meth:`materialize_unit` (their parameters on meta)."""
        return self._pending is not None

    def refuse_if_lazy(self) -> None:
        if self._pending is not None:
            raise RuntimeError(f"this {type(self).__name__} was built lazily (its units wait for "
                               "materialize_unit): call materialize() before using it as a module")

    def materialize_unit(self, u: int) -> None:
        """Give unit ``u``'s parameters their values on the CPU; units come in order (0, 1, ...)."""
        pending = self._pending
        if pending is None:
            return
        if u != pending["next"]:
            raise RuntimeError(f"lazy {type(self).__name__}: unit {u} asked for, but units materialise "
                               f"in order; next is {pending['next']}")
        self.set_unit(u, pending["values"](u))
        pending["next"] += 1
        if pending["next"] == len(self.units()):
            self._pending = None

    def materialize(self, device: str | torch.device | None = None):
        """Materialise every remaining unit (then move to ``device``): a plain module again."""
        while self._pending is not None:
            self.materialize_unit(self._pending["next"])
        return self.to(device) if device is not None else self

    @torch.no_grad()
    def set_unit(self, u: int, values: dict[str, torch.Tensor]) -> None:
        """Give unit ``u``'s parameters ``values`` (by local name, cast to each parameter's dtype).
        A parameter on meta gets them swapped in, so the parameter object stays the one every
        reference holds; a real one has them copied in."""
        for name, p in self.units()[u].named_parameters():
            value = values[name].to(p.dtype)
            if p.is_meta:
                torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))
            else:
                p.copy_(value)
