"""The engine a user's loop drives: ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``.

Each call checks its own use first (``step()`` before ``backward()``, a second ``backward()``,
a loss that is not a scalar or not computed from the output, a batch of another shape), then
agrees with the other ranks (``calls.py``), and only then acts: a call that raises
:class:`ZdslApiError` has had no effect, unless its message says the step failed, after which
every call raises that failure. The step graph itself runs on the engine's trio loop
(``background.py``, ``flow.py``).

Accumulation as DeepSpeed's engine and ``zdsl run`` have it: ``train accumulate=K`` micro-batches
per step; the gradient of each micro-batch's loss is divided by K (and multiplied by the fp16 loss
scale) before the last unit's backward, as ``zdsl run`` divides its loss; ``step()`` runs the
optimizer step after the K-th backward (``is_boundary``) and is a no-op before it.
"""
from __future__ import annotations

import torch

from zdsl.errors import ZdslApiError
from zdsl.runtime.api import saving
from zdsl.runtime.api.batches import as_batch
from zdsl.runtime.api.calls import engine_call

IDLE, FORWARD, BACKWARD = "between steps", "after engine(x)", "after engine.backward(loss)"


class Engine:
    """One rank's training under a schedule, driven by the user's loop (``zdsl.initialize``)."""

    def __init__(self, run, stack, loop, flow, calls, compiled, eval_executor, first_step: int = 0):
        self.run, self._stack, self._loop, self._flow, self._calls = run, stack, loop, flow, calls
        self._compiled, self._eval_executor = compiled, eval_executor
        self.accumulate = run.graph.accumulate
        self.global_step = first_step       # optimizer steps taken (a loaded checkpoint's count)
        self.grad_norm: float | None = None     # of the last step, where the schedule computes it
        self.loss: float | None = None          # this rank's mean loss of the last step
        self.training = True
        self._phase, self._micro = IDLE, 0
        self._output: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []
        self._failed: str | None = None
        self._closed = False

    # -- what the user reads ---------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.run.rank

    @property
    def world(self) -> int:
        return self.run.world

    @property
    def device(self) -> torch.device:
        return self.run.device

    @property
    def is_boundary(self) -> bool:
        """Whether the current micro-batch (the next one between steps) is its step's last: the
        ``step()`` after its backward runs the optimizer."""
        micro = 0 if self._phase == IDLE else self._micro
        return micro == self.accumulate - 1

    @property
    def lr(self) -> float:
        """The learning rate of the step in progress (between steps: of the next one)."""
        return self.run.rates.at(self.global_step)

    @property
    def loss_scale(self) -> float:
        """fp16's dynamic loss scale (1.0 in other precisions)."""
        scaler = self.run.state.scaler
        return float(scaler.scale) if scaler.enabled else 1.0

    def train(self, mode: bool = True) -> "Engine":
        self.training = bool(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    # -- the loop's calls ------------------------------------------------------------------
    @engine_call
    def __call__(self, x) -> torch.Tensor:
        """The last unit's output for ``x``; attached to autograd for ``backward`` (see the module)."""
        if not torch.is_grad_enabled() or not self.training:
            return self._forward_only(x)
        call = "engine(x)"
        micro = 0 if self._phase == IDLE else self._micro + 1
        batch, problem = self._batch(x, call, training=True)
        problem = problem or self._forward_problem()
        self._agree(call, micro, problem)
        if micro == 0:
            self._losses = []
        out = self._on_loop(self._loop.call, self._flow.forward, micro, batch.to(self.device),
                            self.global_step if micro == 0 else None, f"rank {self.rank}: {call}")
        self._phase, self._micro, self._output = FORWARD, micro, out
        return out

    @engine_call
    def backward(self, loss: torch.Tensor) -> None:
        """The schedule's backward from ``loss``, a scalar computed from the last ``engine(x)``'s output."""
        call = "engine.backward(loss)"
        grad, problem = None, self._failure()
        if problem is None and self._phase != FORWARD:
            problem = (f"rank {self.rank}: {call} twice for one engine(x): one backward per forward"
                       if self._phase == BACKWARD else
                       f"rank {self.rank}: {call} without engine(x): call engine(x) first and compute the loss "
                       f"from its output")
        if problem is None:
            grad, problem = output_gradient(loss, self._output, self._grad_scale(), self.accumulate,
                                            f"rank {self.rank}: {call}")
        self._agree(call, self._micro, problem)
        self._losses.append(loss.detach().float().reshape(()))
        if self._micro in self._flow.last_backward:
            self._on_loop(self._loop.call_sync, self._flow.hand_gradient, self._micro, grad)
        self._phase, self._output = BACKWARD, None

    @engine_call
    def step(self) -> None:
        """The optimizer step after the accumulation window's last backward; a no-op before it."""
        call = "engine.step()"
        problem = self._failure()
        if problem is None and self._phase != BACKWARD:
            problem = f"rank {self.rank}: {call} before engine.backward(loss): each engine(x) needs its backward " \
                      f"before the step"
        self._agree(call, self._micro, problem)
        if self._micro < self.accumulate - 1:
            return
        result = self._on_loop(self._loop.call, self._flow.finish, f"rank {self.rank}: {call}")
        self.global_step += 1
        self.grad_norm = result.get("grad_norm")
        self.loss = float(torch.stack(self._losses).mean())
        self._phase, self._micro = IDLE, 0

    # -- between steps (saving.py) ---------------------------------------------------------
    def gathered(self):
        """``with engine.gathered():`` the model's full parameters readable on every rank (changes
        are not kept); resharded after."""
        return saving.gathered(self)

    @engine_call
    def state_dict(self) -> dict:
        """The full fp32 state dict on rank 0 (every rank calls it; the others get ``{}``)."""
        return saving.state_dict(self)

    @engine_call
    def save_checkpoint(self, folder, client_state: dict | None = None):
        """A sharded checkpoint under ``folder`` (``zdsl run --resume`` reads it), with ``client_state``."""
        return saving.save_checkpoint(self, folder, client_state)

    @engine_call
    def load_checkpoint(self, folder) -> tuple[str, dict]:
        """Load ``folder``'s newest checkpoint (or a step folder), at any rank count; as DeepSpeed's,
        the step folder loaded and its ``client_state``."""
        return saving.load_checkpoint(self, folder)

    @engine_call
    def export(self, folder, format: str = "hf", dtype: str = "fp32") -> list[str]:
        """The trained model as a folder ``from_pretrained`` loads (``format="hf"``, rank 0 writes;
        every rank calls it, between steps); the files written."""
        from zdsl.runtime.api.hf import export_hf_folder
        if format != "hf":
            raise ZdslApiError(f"engine.export: format={format!r}: the formats are \"hf\" (a Hugging Face "
                               f"folder); for zdsl's own, engine.state_dict() or engine.save_checkpoint(DIR)")
        return export_hf_folder(self, folder, dtype)

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine's loop, remove its NVMe files, leave the group it joined (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._loop.alive:
            try:
                self._loop.call_sync(self._flow.cancel)
            except Exception:   # noqa: BLE001 - the loop is ending anyway
                pass
        self._loop.close()
        self._stack.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------
    def _forward_only(self, x) -> torch.Tensor:
        call = "engine(x) without gradients"
        batch, problem = self._batch(x, call, training=False)
        problem = problem or self._between_steps(call)
        self._agree(call, 0, problem)
        return self._on_loop(self._loop.call, self._flow.evaluate, self._eval_executor, batch.to(self.device),
                             not self.training, f"rank {self.rank}: {call}")

    def _batch(self, x, call: str, training: bool):
        try:
            batch = as_batch(x, call, self.rank)
        except ZdslApiError as exc:
            return None, str(exc)
        return batch, self._compiled.check(batch, call, self.rank, training)

    def _forward_problem(self) -> str | None:
        failed = self._failure()
        if failed or self._phase == IDLE:
            return failed
        if self._phase == FORWARD:
            return (f"rank {self.rank}: engine(x) again before engine.backward(loss) for micro-batch {self._micro}'s "
                    f"output: one backward per forward (a forward without one: under torch.no_grad())")
        if self._micro == self.accumulate - 1:
            return (f"rank {self.rank}: engine(x) after the last backward of step {self.global_step}'s "
                    f"{self.accumulate} micro-batch(es): call engine.step() first")
        return None

    def _between_steps(self, call: str) -> str | None:
        failed = self._failure()
        if failed or self._phase == IDLE:
            return failed
        return (f"rank {self.rank}: {call} inside step {self.global_step} (micro-batch {self._micro} is "
                f"{self._phase}); a forward-only pass, gathered(), state_dict() and checkpoints come between "
                f"steps, after engine.step()")

    def _failure(self) -> str | None:
        if self._closed:
            return f"rank {self.rank}: the engine is closed"
        return self._failed

    def _agree(self, call: str, micro: int, problem: str | None) -> None:
        self._calls.agree(call, self.global_step, micro, problem)

    def _on_loop(self, how, *args):
        """Run on the trio loop; a failure there stops the engine (every later call raises it)."""
        try:
            return how(*args)
        except ZdslApiError as exc:
            self._failed = f"the engine stopped: {exc}"
            raise
        except Exception as exc:
            self._failed = f"the engine stopped: rank {self.rank}: {type(exc).__name__}: {exc}"
            raise ZdslApiError(self._failed) from exc

    def _grad_scale(self) -> float | None:
        scaler = self.run.state.scaler
        return scaler.scale if scaler.enabled else None


def output_gradient(loss, output: torch.Tensor | None, scale: float | None, accumulate: int, call: str):
    """d loss / d output, scaled as ``zdsl run`` scales its loss (the fp16 loss scale, then 1/accumulate):
    ``(grad, None)``, or ``(None, why)`` for a loss that is no scalar or not computed from ``output``."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        return None, f"{call}: the loss must be a scalar tensor, got {what} (reduce it, e.g. .mean())"
    if not loss.requires_grad or output is None or not output.requires_grad:
        return None, f"{call}: the loss was not computed from the output of the last engine(x) (it has no gradient)"
    seed = torch.full_like(loss, scale) if scale is not None else torch.ones_like(loss)
    try:
        (grad,) = torch.autograd.grad(loss, output, grad_outputs=seed)
    except RuntimeError as exc:
        return None, (f"{call}: the loss was not computed from the output of the last engine(x) "
                      f"({str(exc).splitlines()[0]})")
    if accumulate > 1:
        grad = grad / accumulate
    return grad, None
