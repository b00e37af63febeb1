"""The Python API: a user's own training loop under a ``.zs`` schedule (``zdsl.initialize``).

::

    engine = zdsl.initialize("zero3.zs", model=model)
    for x, y in loader:
        out = engine(x)                     # the schedule's forward
        loss = F.cross_entropy(out, y)      # the user's loss, on the user's thread
        engine.backward(loss)               # the schedule's backward
        engine.step()                       # the optimizer step at the accumulation boundary

How the schedule's step graph runs across the user's calls
-----------------------------------------------------------
The schedule stays the one place where sharding, offload, prefetch and overlap are decided:
the engine runs the same step graph ``zdsl run`` runs, with the same rank set-up
(``runtime/run/train.py``'s ``open_rank``: group, graph agreement, rank state, executor) and
step frame (``RankRun.begin_step``/``run_step``/``end_step``). What differs is who feeds it.

* **A loop kept alive.** The rank's executor runs on a trio loop in a background thread for the
  engine's life (``background.py``). The user's thread hands it work and waits for it.
* **Gates.** A step's graph starts at its first ``engine(x)``; micro-batch ``m``'s first-unit
  forward waits for the batch ``engine(x)`` hands it, and its last-unit backward waits for the
  gradient ``engine.backward`` computes (``Executor.gates``; ``flow.py``). Every other op runs as
  soon as its dependencies allow: the backward's first gathers and NVMe reads start while the
  user computes the loss.
* **The output.** ``engine(x)`` returns once the last unit's forward has run, with that unit's
  *output* (not a loss of zdsl's) as a detached leaf that requires grad
  (``runtime/state/compute.py``'s ``user_loop``). ``engine.backward(loss)`` computes
  d loss / d output with autograd on the user's thread, scaled as ``zdsl run`` scales its loss
  (the fp16 loss scale, then 1/accumulate), and hands it to the last unit's backward. A model of
  the unit protocol whose last unit returns its loss from the labels is trained by
  ``engine.backward(engine((inputs, labels)))`` exactly as ``zdsl run`` trains it.
* **The step.** ``engine.step()`` after the accumulation window's last backward waits for the
  step's remaining ops (reduce-scatters, norm, optimizer) and returns after them; before the
  boundary it is a no-op (DeepSpeed's semantics; ``engine.is_boundary``). The learning rate is
  the schedule's at the global step (``train steps=`` spans the schedule; later steps keep its
  last rate).
* **Forward-only.** Under ``torch.no_grad()`` or after ``engine.eval()``, ``engine(x)`` runs the
  forward-only graph (the schedule's ``eval`` graph, else one made from its pipelines) on the same
  buffers between steps, leaving training's bits untouched (``RankState.evaluation``).
* **Errors and hangs.** Each call checks its use and then agrees with the other ranks
  (``calls.py``) before it acts, so a misuse on one rank is an error on every rank at once, and
  ranks that disagree on the call are named. An op that fails on the loop thread reaches the
  user's next call as a :class:`ZdslApiError` naming the rank, the op and the cause. Every wait
  of the user's thread is bounded by the collective timeout.

* **The random generators.** A step's units draw from torch's global generators on the loop's
  threads (dropout; a recompute replays them), as in ``zdsl run``; a loop that draws from them
  between ``engine(x)`` and ``engine.step()`` races with the step: draw from a
  ``torch.Generator`` of its own (as a ``DataLoader`` with a seeded generator does).
* **Closing.** ``engine.close()`` (or leaving ``with``; else at exit) ends a step still running,
  removes the NVMe files and leaves the process group the engine joined.

Files: ``setup.py`` (``initialize``), ``engine.py`` (the surface), ``flow.py`` (the trio side of a
step), ``background.py`` (the loop), ``calls.py`` (agreement), ``batches.py`` (what ``engine(x)``
takes and the compiled shape), ``saving.py`` (gathered parameters, state dict, checkpoints),
``given.py`` (a user's model object as units), ``deferred.py`` (a schedule without ``data`` whose
graph waits for the first ``engine(x)``'s row); :class:`ZdslApiError` is ``zdsl/errors.py``'s.

``import zdsl`` stays torch-free: ``zdsl.initialize`` and ``zdsl.units`` import this package when
called.
"""
from zdsl.errors import ZdslApiError
from zdsl.runtime.api.given import units
from zdsl.runtime.api.setup import initialize

__all__ = ["ZdslApiError", "initialize", "units"]
