"""``data python("file.py:batches", k=v...)``: any data, from a function of the user's.

The contract (the language reference repeats it)::

    def batches(seed, step, micro, rank, world, batch, **settings) -> (inputs, targets)

zdsl calls it with keyword arguments, once per micro-batch on each rank, and adds the
schedule's ``k=v`` settings (``python("data.py:batches", features=16)`` passes
``features=16``). It returns one micro-batch of this rank, the pair ``(inputs, targets)``
of torch tensors, each with ``batch`` rows first: float or integer, of any further shape
(features, token ids, images, class labels). ``inputs`` is what unit 0 of the model gets,
``targets`` is ``batch.labels`` (the unit protocol, zdsl/runtime/models/protocol.py). It
is what DeepSpeed is handed as ``training_data`` and a ``DataLoader`` would feed.

It must be a pure function of its arguments: the same arguments give the same tensors,
on any rank and at any time (zdsl, the DDP reference and a resumed run all ask for
the same micro-batch by its arguments, in any order). Draw from a generator seeded by
them, e.g. ``torch.Generator().manual_seed(hash((seed, step, micro, rank)))`` (Python's
``hash`` of a tuple of ints is the same in every process), never from the global random
state. Every call gives the same shapes and dtypes (the plan sizes memory from them).

zdsl's own sources number a
step's samples so that row ``i`` of rank ``r``'s micro-batch ``m`` is global sample
``(m * world + r) * batch + i`` (``zdsl.runtime.data.first_sample``); a function that draws
each row from ``(seed, step, that index)`` gives any split of the same global batch (2 ranks,
or 1 rank accumulating 2) the same samples, which a checkpoint resumed at another rank count
needs to continue exactly (programs/classifier.py does).

Every way a function can break this is a :class:`PythonDataError` naming the function,
the call and what it returned: not a pair, not tensors, the wrong number of rows, shapes or
dtypes that differ from the first call (another step or rank), or two calls with the same
arguments that differ (:func:`python_problem`, run before any rank starts).
"""
from __future__ import annotations

import functools
import inspect

import torch

from zdsl.runtime.data.source import RuntimeSource
from zdsl.runtime.models.batch import IGNORE_INDEX
from zdsl.sources.python import CALL_ARGS, PythonDataError


def describe(value) -> str:
    """What a function returned, short enough for one line of an error."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{'an' if dtype.startswith('int') else 'a'} {dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_kind(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"a {type(value).__name__} of {len(value)} items ({inner})"
    return f"a value of type {type(value).__name__}"


def _kind(value) -> str:
    return "tensor" if isinstance(value, torch.Tensor) else type(value).__name__


def where(spec) -> str:
    return f'data python("{spec.source}")'


@functools.lru_cache(maxsize=8)
def _load(source: str):
    from zdsl.runtime.models.protocol import ModelProtocolError, load_factory
    try:
        return load_factory(source, what=f'data python("{source}")')
    except ModelProtocolError as exc:
        raise PythonDataError(str(exc)) from None


def load_function(spec):
    """The function ``spec`` names (imported once per process)."""
    return _load(spec.source)


def python_batch(spec, seed: int, step: int, micro: int, rank: int, world: int, batch: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch from the user's function, checked against the contract, detached (it moves
    to the rank's device with the rest of the batch)."""
    fn = load_function(spec)
    kwargs = dict(seed=seed, step=step, micro=micro, rank=rank, world=world, batch=batch)
    shown = f"{fn.__name__ if hasattr(fn, '__name__') else 'the function'}" \
            f"({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
    problem = _binding_problem(fn, {**kwargs, **spec.args})
    if problem:
        settings = ", ".join(f"{k}={v!r}" for k, v in spec.args.items())
        raise PythonDataError(f"{where(spec)}: cannot call {shown}{' with ' + settings if settings else ''}: "
                              f"{problem}; it takes the keyword arguments {', '.join(CALL_ARGS)} (and the "
                              f"schedule's settings)")
    try:
        out = fn(**kwargs, **spec.args)
    except Exception as exc:
        raise PythonDataError(f"{where(spec)}: {shown} raised {type(exc).__name__}: {exc}") from None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise PythonDataError(f"{where(spec)}: {shown} returned {describe(out)}; it must return one micro-batch, "
                              f"the pair (inputs, targets) of tensors")
    for name, t in zip(("inputs", "targets"), out):
        if not isinstance(t, torch.Tensor):
            hint = " (torch.from_numpy makes one from a numpy array)" if type(t).__module__ == "numpy" else ""
            raise PythonDataError(f"{where(spec)}: {shown} returned {describe(t)} as {name}, not a torch "
                                  f"tensor{hint}")
        if t.is_complex():
            raise PythonDataError(f"{where(spec)}: {shown} returned {describe(t)} as {name}; zdsl trains on "
                                  f"float or integer tensors")
        if t.dim() == 0 or t.shape[0] != batch:
            what = f"{t.shape[0]} rows" if t.dim() else "a scalar"
            raise PythonDataError(f"{where(spec)}: {shown} returned {describe(t)} as {name}: {what}, but a "
                                  f"micro-batch has batch={batch} rows first")
    inputs, targets = (t.detach() for t in out)
    _same_as_first(spec, shown, inputs, targets)
    return inputs, targets


def _binding_problem(fn, kwargs: dict) -> str | None:
    """Why ``fn`` cannot take these keyword arguments, or None (also when its signature is hidden)."""
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as exc:
        return str(exc)
    except ValueError:      # a builtin or extension without a signature: the call itself will say
        pass
    return None


def signature(inputs: torch.Tensor, targets: torch.Tensor) -> tuple:
    """Shapes past the batch rows, and dtypes: what every call must give alike."""
    return (tuple(inputs.shape[1:]), inputs.dtype, tuple(targets.shape[1:]), targets.dtype)


_FIRST: dict[tuple[str, str], tuple[str, tuple]] = {}     # (source, settings) -> the first call and its signature


def _same_as_first(spec, shown: str, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    mine = signature(inputs, targets)
    first = _FIRST.setdefault((spec.source, repr(sorted(spec.args.items()))), (shown, mine))
    if first[1] != mine:
        raise PythonDataError(f"{where(spec)}: {shown} returned inputs {_pair(mine[:2])} and targets "
                              f"{_pair(mine[2:])}, but {first[0]} returned inputs {_pair(first[1][:2])} and "
                              f"targets {_pair(first[1][2:])}; every call must give the same shapes and dtypes "
                              f"(after the batch rows)")


def _pair(sig: tuple) -> str:
    return f"{str(sig[1]).removeprefix('torch.')} {('batch', *sig[0])}".replace("'", "")


def meta_sample(spec) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample (``batch=1``) of the data's shapes and dtypes on the meta device, to size a model."""
    inputs, targets = python_batch(spec, 0, 0, 0, 0, 1, 1)
    return (torch.empty(inputs.shape, dtype=inputs.dtype, device="meta"),
            torch.empty(targets.shape, dtype=targets.dtype, device="meta"))


def python_problem(spec, seed: int, world: int, batch: int, model=None) -> str | None:
    """``zdsl run``'s check before any rank starts: call the function as rank 0 twice and as the last
    rank once, at step 0; with ``model`` (a ``ModelSpec``) the built-in GPT or an ``hf`` model, whose
    inputs are token ids, check them against its vocab and context too. The reason it cannot train,
    or None."""
    try:
        first = python_batch(spec, seed, 0, 0, 0, world, batch)
        again = python_batch(spec, seed, 0, 0, 0, world, batch)
        last = python_batch(spec, seed, 0, 0, world - 1, world, batch)    # shapes compared with rank 0's
    except PythonDataError as exc:
        return str(exc)
    fn = load_function(spec)
    name = getattr(fn, "__name__", "the function")
    shown = f"{name}(seed={seed}, step=0, micro=0, rank=0, world={world}, batch={batch})"
    for part, a, b in zip(("inputs", "targets"), first, again):
        if not torch.equal(a, b):
            return (f"{where(spec)}: two calls of {shown} returned different {part}; the function must be a pure "
                    f"function of its arguments (seed a generator from them: torch.Generator()"
                    f".manual_seed(hash((seed, step, micro, rank))), never the global random state)")
    vocab, context = token_limits(model)
    if vocab is None:
        return None
    for rank, (inputs, targets) in ((0, first), (world - 1, last)):
        problem = _token_problem(inputs, targets, vocab, context, model)
        if problem:
            return f"{where(spec)}: {shown.replace('rank=0', f'rank={rank}')} returned {problem}"
    return None


def token_limits(model) -> tuple[int | None, int | None]:
    """``(vocab, context)`` of a model whose first unit takes token ids (the built-in GPT, an ``hf``
    model); ``(None, None)`` for a model of the user's, whose inputs are its own business."""
    if model is None or model.kind not in ("gpt", "hf"):
        return None, None
    if model.kind == "gpt":
        from zdsl.schedule import GPT_DEFAULTS
        sizes = {**GPT_DEFAULTS, **model.args}
    else:
        from pathlib import Path

        from zdsl.model.hf_folder import model_sizes
        sizes = model_sizes(Path(model.path), model.args)
    return sizes.get("vocab"), sizes.get("context")


def _token_problem(inputs: torch.Tensor, targets: torch.Tensor, vocab: int, context: int | None, model) -> str | None:
    """What is wrong with these as token ids and next-token labels for ``model``, or None."""
    named = "model gpt(...)" if model.kind == "gpt" else "an hf model"
    if inputs.is_floating_point() or inputs.dtype == torch.bool or inputs.dim() != 2:
        return f"{describe(inputs)} as inputs, but {named} takes token ids: an integer (batch, tokens) tensor"
    if targets.shape != inputs.shape or targets.is_floating_point():
        return (f"{describe(targets)} as targets, but {named} takes one integer label per input token "
                f"(shape {tuple(inputs.shape)})")
    if context is not None and inputs.shape[1] > context:
        return f"{inputs.shape[1]} tokens per row, more than the model's context {context}"
    for part, t, allowed in (("inputs", inputs, None), ("targets", targets, IGNORE_INDEX)):
        bad = (t < 0) | (t >= vocab)
        if allowed is not None:
            bad &= t != allowed
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            return (f"id {int(t[row, col])} in {part} (row {row}, token {col}), not in 0..{vocab - 1}, the "
                    f"model's vocab" + (" (-100: not counted)" if allowed is not None else ""))
    return None


class PythonSource(RuntimeSource):
    kind = "python"

    def prepare(self, spec, schedule, progress: bool = False) -> tuple[str | None, str | None]:
        """A broken contract stops here, not inside a rank."""
        train = schedule.train
        return python_problem(spec, train.seed, schedule.ranks, train.batch, model=schedule.model), None

    def batch(self, spec, seed: int, step: int, micro: int, rank: int, ranks: int, batch: int):
        return python_batch(spec, seed, step, micro, rank, ranks, batch)

    def meta_sample(self, spec) -> tuple[torch.Tensor, torch.Tensor]:
        return meta_sample(spec)

    def row_origin(self, spec) -> str:
        return f'each row as data python("{spec.source}") gives it'


SOURCE = PythonSource()
