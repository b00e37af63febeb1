"""What every data source is on the compiler side: :class:`DataSource`, and the call being checked.

A source is one object per kind (``corpus``, ``tokens`` ...; the registry is
``zdsl/sources/__init__.py``) that says:

- its settings and how its ``KIND(...)`` call is checked into a :class:`~zdsl.schedule.DataSpec`
  (:meth:`DataSource.check`, reporting through the :class:`SourceCall`);
- how it meets the model: the context and vocab it defaults to and must fit in
  (:meth:`DataSource.fit_model`), what it must state for a model zdsl cannot see into;
- what it tells the sizing: whether its rows are token ids of a context (:attr:`DataSource.token_ids`;
  else a built model is sized from one row of its own tensors) and whether they come padded or
  packed with an attention mask (:attr:`DataSource.masked`);
- how it is written back as ``.zs`` (:meth:`DataSource.written`).

The runtime side of the same kind (prepare once, batches) is ``zdsl/runtime/data/<kind>.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from zdsl.check.values import Reader
from zdsl.lang import ast
from zdsl.schedule import DataSpec, Span

MAX_SETTING = 1 << 24          # the largest integer setting (context, vocab)


@dataclass
class SourceCall:
    """A ``KIND(...)`` data source call being checked (``data``'s or ``eval``'s): its syntax, the
    reporter its problems go to, and ``key`` ("data" or "eval.data"), under which the spans of its
    settings are kept in the schedule (``record`` keeps one)."""
    call: ast.Call
    key: str
    report: Reader
    record: Callable[[str, Span], None]
    length: int | None = None          # tokens the source holds, where its check read them
    source_span: Span | None = None    # the file argument's, once read

    def span(self, name: str, span: Span) -> None:
        self.record(f"{self.key}.{name}", span)

    def positional(self) -> list[ast.Arg]:
        return [a for a in self.call.args if a.key is None]

    def keyword(self) -> list[ast.Arg]:
        return [a for a in self.call.args if a.key is not None]


@dataclass
class ModelFit:
    """The model a source is checked against: its ``context`` and ``vocab``, ``opening`` (the
    model statement's call up to its settings, ``gpt(`` or ``hf(..., ``, for the hints), and
    where the schedule's statements are (``spans``)."""
    context: int
    vocab: int
    opening: str
    spans: dict[str, Span]
    key: str
    report: Reader = field(repr=False)

    def at(self, *keys: str) -> Span | None:
        """The first of ``keys`` the schedule set (each under the source's key where it starts with '.')."""
        for k in keys:
            span = self.spans.get(f"{self.key}{k}" if k.startswith(".") else k)
            if span is not None:
                return span
        return None


class DataSource:
    """One kind of ``data KIND(...)``; subclasses set the class attributes and override the hooks."""
    kind: str = ""
    settings: tuple[str, ...] = ()     # the key=value settings it takes
    example: str = ""                  # a whole call, for hints
    argument: str | None = None        # its first, positional argument: "file", "function" or None
    token_ids = True                   # rows of token ids, checked against the model's context and vocab
    masked = False                     # rows padded or packed: the model holds an attention mask
    vocab_from_model = False           # its vocab defaults to the model's (else fixed, or the tokenizer's)
    bare: tuple[str, ...] = ()         # settings whose value is a name, printed unquoted (``dtype=uint16``)

    def sizes_the_model(self, spec: DataSpec) -> bool:
        """Whether the model's sizing takes ``spec`` (``zdsl.compile.models.units_for``'s ``data``)."""
        return self.masked or not self.token_ids

    # -- the call -----------------------------------------------------------------------

    def check(self, at: SourceCall) -> DataSpec | None:
        """The spec ``at.call`` describes, every problem reported; None where it cannot be built."""
        call, report = at.call, at.report
        positional = at.positional()
        spec = DataSpec(self.kind)
        if self.argument == "file":
            if not positional:
                report.error(call.span, f"{self.kind} needs a source", hint=self.example)
                return None
            first = positional.pop(0).value
            at.source_span = first.span
            spec.source = report.string(first, f"the {self.kind} file")
            if spec.source is not None:
                spec.source = self.resolve(spec.source, first.span, report)
        for extra in positional:
            report.error(extra.span, f"{self.kind} takes key=value settings here")
        given = report.keywords(at.keyword(), self.settings, f"{self.kind}()")
        for name, arg in given.items():
            self.read_setting(name, arg, spec, at)
        return self.finish(spec, given, at)

    def resolve(self, given: str, span: Span, report: Reader) -> str | None:
        """The file argument made absolute and checked to exist; None after an error."""
        return given

    def read_setting(self, name: str, arg: ast.Arg, spec: DataSpec, at: SourceCall) -> None:
        """One key=value setting into ``spec`` (by default a positive integer)."""
        value = at.report.integer(arg.value, f"{self.kind}({name}=)", 1, MAX_SETTING)
        if value is not None:
            spec.args[name] = value
            at.span(name, arg.span)

    def finish(self, spec: DataSpec, given: dict[str, ast.Arg], at: SourceCall) -> DataSpec | None:
        """The checks that need every setting read."""
        return spec

    # -- against the model ----------------------------------------------------------------

    def fit_model(self, spec: DataSpec, fit: ModelFit) -> None:
        """The data's context and vocab default to the model's and must fit in them."""
        spec.args.setdefault("context", fit.context)
        if self.vocab_from_model:
            spec.args.setdefault("vocab", fit.vocab)
        if spec.args["context"] > fit.context:
            fit.report.error(fit.at(".context", fit.key), f"data context {spec.args['context']} is longer "
                             f"than the model's context {fit.context}",
                             hint=f"model {fit.opening}context={spec.args['context']}) or a shorter data context")
        self.check_vocab(spec, fit)

    def check_vocab(self, spec: DataSpec, fit: ModelFit) -> None:
        if self.vocab_from_model and spec.args["vocab"] > fit.vocab:
            fit.report.error(fit.at(".vocab", ".context", fit.key),
                             f"data vocab {spec.args['vocab']} is larger than the model's vocab {fit.vocab}")

    def user_model_needs(self) -> tuple[str, ...]:
        """What the data must state for a model zdsl cannot see into (a user's, an unsized ``hf``)."""
        return ("context", "vocab") if self.vocab_from_model else ("context",)

    def user_model_example(self) -> str:
        return self.example

    def check_length(self, spec: DataSpec, at: SourceCall, spans: dict[str, Span]) -> None:
        """Once the context is known: whether the source holds a window of it."""

    # -- back to text -------------------------------------------------------------------

    def written(self, spec: DataSpec) -> tuple[str | None, list[tuple[str, object]]]:
        """The call as ``zdsl plan --lowered`` prints it: its positional argument (None: none) and
        its settings in order (the names of :attr:`bare` are printed unquoted)."""
        return ((spec.source or "") if self.argument else None), list(spec.args.items())
