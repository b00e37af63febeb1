"""The trio side of the user's steps: one run of the step graph per step, fed by the user's calls.

Each method runs on the engine's trio loop (``background.py``). :meth:`StepFlow.begin` starts
the step graph as a task; its micro-batch ``m`` waits at two gates (``Executor.gates``): unit 0's
forward for the batch (:meth:`feed`), the last unit's backward for the gradient of the output
(:meth:`hand_gradient`). Every other op runs as soon as its dependencies allow, so what does not
depend on the user (gathers, prefetch, NVMe reads) goes on between the calls. The user's thread
waits for an op (:meth:`wait_forward`) or for the step (:meth:`finish`), never longer than the
timeout; a step that failed raises its error (the rank, the op, the cause) at the next wait.
"""
from __future__ import annotations

import functools

import trio

from zdsl.errors import ZdslApiError
from zdsl.runtime.exec.errors import describe_op
from zdsl.runtime.exec.executor import Executor


class StepFlow:
    """The step graph of one rank (``RankRun``) run across the user's calls."""

    def __init__(self, run, nursery: trio.Nursery, timeout_s: float):
        self.run, self.nursery, self.timeout_s = run, nursery, timeout_s
        self.state = run.state
        graph = run.graph
        last = len(graph.units) - 1
        ops = graph.ops
        self.first_forward = {op.micro: op.id for op in ops if op.kind == "compute.forward" and op.unit == 0}
        self.last_forward = {op.micro: op.id for op in ops if op.kind == "compute.forward" and op.unit == last}
        self.last_backward = {op.micro: op.id for op in ops if op.kind == "compute.backward" and op.unit == last}
        gates = {i: functools.partial(self._gate, "fed", m) for m, i in self.first_forward.items()}
        gates.update({i: functools.partial(self._gate, "grads", m) for m, i in self.last_backward.items()})
        run.executor.gates = gates
        run.state.compute.user_loop = True
        self.step = -1
        self.fed: list[trio.Event] = []
        self.grads: list[trio.Event] = []
        self.finished = trio.Event()
        self.finished.set()
        self.error: BaseException | None = None

    @property
    def running(self) -> bool:
        return not self.finished.is_set()

    async def _gate(self, kind: str, micro: int) -> None:
        await getattr(self, kind)[micro].wait()

    # -- a training step --------------------------------------------------------------------
    def begin(self, step: int) -> float:
        """Start step ``step``'s graph (its learning rate set, returned); its micro-batches come later."""
        acc = self.state.compute.accumulate
        self.fed = [trio.Event() for _ in range(acc)]
        self.grads = [trio.Event() for _ in range(acc)]
        self.finished, self.error, self.step = trio.Event(), None, step
        lr = self.run.begin_step(step, None, timed=False)
        self.nursery.start_soon(self._run)
        return lr

    async def _run(self) -> None:
        try:
            await self.run.run_step()
        except Exception as exc:    # noqa: BLE001 - reported at the user's next call
            self.error = exc
        finally:
            self.finished.set()

    async def forward(self, micro: int, batch, step: int | None, call: str):
        """Step ``step``'s graph started (where given: the step's first micro-batch), micro-batch
        ``micro`` fed, and its output once the forward has run (:meth:`wait_forward`): one hand-off
        from the user's thread for what would otherwise be three."""
        if step is not None:
            self.begin(step)
        self.feed(micro, batch)
        return await self.wait_forward(micro, call)

    def feed(self, micro: int, batch) -> None:
        """Micro-batch ``micro`` for unit 0's forward (a ``Batch`` on the rank's device)."""
        self.state.compute.feed(micro, batch)
        self.fed[micro].set()

    def hand_gradient(self, micro: int, grad) -> None:
        """The gradient of micro-batch ``micro``'s output, for the last unit's backward."""
        self.state.compute.grad_outs[micro] = grad
        self.grads[micro].set()

    async def wait_forward(self, micro: int, call: str):
        """The last unit's output for ``micro`` (a detached leaf), once its forward has run."""
        op = self.last_forward[micro]
        await self._wait(self.run.executor.done[op], call, f"the forward of micro-batch {micro} "
                         f"(op {describe_op(self.run.graph.ops[op])})")
        return self.state.compute.outputs.pop(micro)

    async def finish(self, call: str) -> dict:
        """Wait for the step's last op; the step's results (``RankState.step_end``)."""
        await self._wait(self.finished, call, f"the end of step {self.step}")
        return self.run.end_step(self.step)

    async def _wait(self, event: trio.Event, call: str, what: str) -> None:
        with trio.move_on_after(self.timeout_s) as scope:
            await first_of(event, self.finished)
        if self.error is not None:
            raise ZdslApiError(f"{call}: step {self.step} failed: {self.error}") from self.error
        if scope.cancelled_caught:
            raise ZdslApiError(f"rank {self.run.rank}: {call} waited {self.timeout_s:g} s for {what}; the step "
                               f"is stuck (a rank that stopped, or a collective that never completes)")

    def cancel(self) -> None:
        """Stop a step that still runs (the engine closes)."""
        if self.running:
            self.nursery.cancel_scope.cancel()

    # -- a forward-only pass -------------------------------------------------------------
    async def evaluate(self, executor: Executor, batch, eval_mode: bool, call: str):
        """The last unit's output for ``batch`` through the forward-only graph, between steps."""
        with trio.move_on_after(self.timeout_s):
            with self.state.evaluation(eval_mode=eval_mode):
                self.state.eval_begin(batch)
                try:
                    await executor.run_step()
                except Exception as exc:    # noqa: BLE001 - the op's error, named
                    raise ZdslApiError(f"{call}: the forward-only pass failed: {exc}") from exc
                return self.state.eval_end()
        raise ZdslApiError(f"rank {self.run.rank}: {call} waited {self.timeout_s:g} s for the forward-only pass; "
                           f"it is stuck (a rank that stopped, or a collective that never completes)")


async def first_of(*events: trio.Event) -> None:
    """Return once any of ``events`` is set."""
    async with trio.open_nursery() as nursery:
        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()
        for event in events:
            nursery.start_soon(wait, event)
