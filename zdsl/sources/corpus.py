"""``data corpus("stdlib" | "PATH", context=N)``: byte-level text (vocab 256), read by the runtime
as it is (``zdsl/runtime/data/corpus.py``)."""
from __future__ import annotations

from pathlib import Path

from zdsl.check.values import Reader
from zdsl.lang.include import path_exists, resolve_relative
from zdsl.schedule import DataSpec, Span
from zdsl.sources.base import DataSource, ModelFit
from zdsl.sources.text import STDLIB

BYTES = 256


class CorpusSource(DataSource):
    kind = "corpus"
    settings = ("context",)
    example = 'corpus("stdlib", context=64)'
    argument = "file"

    def resolve(self, given: str, span: Span, report: Reader) -> str | None:
        """"stdlib", or a path relative to the schedule file (else to the working folder)."""
        if given == STDLIB:
            return given
        here = Path(resolve_relative(given, span.file))
        for candidate in (here, Path(given)):
            if path_exists(candidate):
                return str(candidate.resolve())
        report.error(span, f"corpus not found: {given}", hint='a path relative to the schedule file, or "stdlib"')
        return None

    def check_vocab(self, spec: DataSpec, fit: ModelFit) -> None:
        if fit.vocab < BYTES:
            fit.report.error(fit.at("model.vocab", "model"), f"corpus data is byte-level ({BYTES} tokens) but "
                             f"the model's vocab is {fit.vocab}", hint=f"model {fit.opening}vocab={BYTES})")

    def written(self, spec: DataSpec) -> tuple[str | None, list[tuple[str, object]]]:
        return spec.source or STDLIB, list(spec.args.items())


SOURCE = CorpusSource()
