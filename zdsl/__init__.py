"""zdsl: ZeRO sharding and offload driven by schedules written in a small language.

This package is the compiler; it never imports torch. The runtime lives in
``zdsl.runtime`` and is imported only by ``zdsl run`` and friends, and by the two
functions below, which bring it in when they are called.
"""
from zdsl.errors import ZdslApiError

__version__ = "0.1.0"
__all__ = ["ZdslApiError", "initialize", "units"]


def initialize(schedule, model=None, **options):
    """The engine that trains under the ``.zs`` file ``schedule`` from the caller's own loop:
    ``out = engine(x)``, ``engine.backward(loss)``, ``engine.step()``. ``model``: a module to
    train instead of the schedule's ``model`` (then the schedule names none). Options:
    ``overrides`` ({key: value}, as ``--set``), ``timeout_s``. See ``zdsl.runtime.api``."""
    from zdsl.runtime.api import initialize as initialize_engine
    return initialize_engine(schedule, model, **options)


def units(model, groups, loss=None):
    """``model`` split into the units ``groups`` lists (module names, or lists of them, in the
    order they run), for ``initialize(..., model=...)``; with ``loss(output, labels)`` the last
    unit returns the loss, as a schedule's own model does. See ``zdsl.runtime.api.given``."""
    from zdsl.runtime.api import units as split_units
    return split_units(model, groups, loss)
