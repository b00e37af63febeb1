"""What a schedule leaves to the user's own loop (``zdsl.initialize``), and what ``zdsl run`` needs.

A schedule without ``model`` trains the module ``initialize(..., model=m)`` gives (model kind
"loop", sized by the API's hook; ``zdsl plan --model FILE.py:FUNCTION`` plans it with a factory's);
one without ``data`` has its batches fed by the loop (the ``fed`` source). ``zdsl check`` accepts
both; ``zdsl run``, which has no loop to take them from, refuses each, positioned, with the fix.
"""
from __future__ import annotations

from zdsl.lang.errors import Diagnostic
from zdsl.schedule import Schedule, Span

PLAN_MODEL = "zdsl plan FILE --model FILE.py:FUNCTION"


def from_loop(schedule: Schedule) -> list[str]:
    """What comes from the user's loop: "the model", "the batches" (for ``zdsl check``'s line)."""
    return [what for what, own in (("the model", schedule.model.kind == "loop"),
                                   ("the batches", schedule.data.kind == "fed")) if own]


def run_refusals(schedule: Schedule) -> list[Diagnostic]:
    """Why ``zdsl run`` cannot train ``schedule``: a model or batches only a loop gives; [] if none."""
    out = []
    start = Span(schedule.file, 1, 1)
    if schedule.model.kind == "loop":
        out.append(Diagnostic("error", start, "zdsl run needs a model statement: without one the model comes from "
                                              "your own loop (zdsl.initialize(FILE, model=m))",
                              'add e.g. `model gpt(layers=2, width=64, heads=4)` or `model "my_model.py:build"()`, '
                              "or drive the schedule from Python with zdsl.initialize"))
    if schedule.data.kind == "fed":
        out.append(Diagnostic("error", schedule.spans.get("data", start),
                              "zdsl run needs a data statement: without one the batches come from your own loop "
                              "(engine(x) after zdsl.initialize)",
                              'add e.g. `data synthetic(vocab=256, context=64)` or `data python("data.py:batches")`, '
                              "or drive the schedule from Python with zdsl.initialize"))
    return out


def refuse_for_run(compiled) -> None:
    """Add :func:`run_refusals` to a ``zdsl run`` compile's diagnostics (``zdsl.driver.Compiled``)."""
    if compiled.schedule is not None:
        compiled.diagnostics.extend(run_refusals(compiled.schedule))
