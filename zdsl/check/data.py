"""Checking the data: ``data KIND(...)`` and ``eval every N steps on KIND(...) batches=K``.

A source call is checked by its kind's object (``zdsl/sources/``, looked up by the callee's
name); once the model is known each source meets it (:meth:`DataChecks.against_model`): its
context and vocab default to the model's and must fit in them, a model zdsl cannot see into
needs them stated, and a file must hold a window of the context.
"""
from __future__ import annotations

from pathlib import Path

from zdsl.check.draft import Draft
from zdsl.lang import ast
from zdsl.model.hf_folder import model_sizes
from zdsl.schedule import GPT_DEFAULTS, DataSpec, EvalSpec
from zdsl.sources import SOURCES, listing, source_of
from zdsl.sources.base import ModelFit, SourceCall


class DataChecks:
    """The sources of ``data`` and ``eval`` in one draft, each call kept under its key ("data",
    "eval.data") until the sources meet the model."""

    def __init__(self, draft: Draft):
        self.draft = draft
        self.calls: dict[str, SourceCall] = {}

    def check_data(self, st: ast.CallStmt) -> None:
        self.draft.span("data", st.span)
        spec = self._source(st.call, "data")
        if spec is not None:
            self.draft.schedule.data = spec

    def check_eval(self, st: ast.EvalStmt) -> None:
        draft, report = self.draft, self.draft.report
        draft.span("eval", st.span)
        every = report.integer(st.every, "eval interval", 1, 10 ** 9)
        batches = 1 if st.batches is None else report.integer(st.batches, "eval batches", 1, 10 ** 6)
        draft.span("eval.data", st.source.span)
        data = self._source(st.source, "eval.data")
        if every is not None and batches is not None and data is not None:
            draft.schedule.eval = EvalSpec(every, data, batches)

    def _source(self, call: ast.Call, key: str) -> DataSpec | None:
        """A source call, checked by its kind; ``key`` prefixes the spans of its settings."""
        report = self.draft.report
        kind = report.choice(call.callee, "data source", tuple(SOURCES)) if isinstance(call.callee, ast.Name) else None
        if kind is None:
            if isinstance(call.callee, ast.Str):
                given = call.callee.value
                report.error(call.callee.span, f"data is {listing()}",
                             hint=f'write python("{given}") for your function' if ":" in given else
                             f'write corpus("{given}") for text, tokens("{given}") for a file of token ids')
            return None
        self.calls[key] = SourceCall(call, key, report, self.draft.span)
        return SOURCES[kind].check(self.calls[key])

    # -- against the model ------------------------------------------------------------------

    def against_model(self) -> None:
        """Each source against the model: the training data's, then eval's (which evaluates at the
        training's context unless told, where both sources are token ids)."""
        schedule = self.draft.schedule
        for key in ("data", "eval.data") if schedule.eval is not None else ("data",):
            spec = self._spec(key)
            if key == "eval.data" and "context" in schedule.data.args and \
                    source_of(schedule.data.kind).token_ids and source_of(spec.kind).token_ids:
                spec.args.setdefault("context", schedule.data.args["context"])
            if source_of(spec.kind).token_ids:      # else its tensors are seen when the runtime calls it
                self._fit_model(key)
            if key in self.calls:
                source_of(spec.kind).check_length(spec, self.calls[key], schedule.spans)

    def _spec(self, key: str) -> DataSpec:
        evaluation = self.draft.schedule.eval
        return evaluation.data if key == "eval.data" and evaluation is not None else self.draft.schedule.data

    def _fit_model(self, key: str) -> None:
        """The source ``key`` against the model's context and vocab, where they are known."""
        draft = self.draft
        model, spans = draft.schedule.model, draft.schedule.spans
        if model.kind == "gpt" and draft.units is not None:
            sizes = {**GPT_DEFAULTS, **model.args}
            self._fit(sizes["context"], sizes["vocab"], "gpt(", key)
        if model.kind == "hf" and model.path is not None:
            hf = model_sizes(Path(model.path), model.args)
            context, vocab = hf["context"], hf["vocab"]
            if context is None or vocab is None:
                self._stated_for_user_model(key)
            else:
                self._fit(context, vocab, 'hf(..., ', key)
        if model.kind == "user" and "model" in spans:
            self._stated_for_user_model(key)

    def _fit(self, context: int, vocab: int, opening: str, key: str) -> None:
        spec = self._spec(key)
        fit = ModelFit(context, vocab, opening, self.draft.schedule.spans, key, self.draft.report)
        source_of(spec.kind).fit_model(spec, fit)

    def _stated_for_user_model(self, key: str) -> None:
        """zdsl cannot see a user model's context or vocab, so the data must state them."""
        spec, spans = self._spec(key), self.draft.schedule.spans
        source = source_of(spec.kind)
        missing = [k for k in source.user_model_needs() if k not in spec.args]
        if missing:
            self.draft.report.error(spans.get(key) or spans["model"],
                                    f"with your own model the data must give its {' and '.join(missing)}",
                                    hint=f"data {source.user_model_example()}")
