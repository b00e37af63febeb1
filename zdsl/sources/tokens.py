"""``data tokens("FILE", dtype=uint16|uint32, context=N, vocab=N)``: a flat file of little-endian
token ids (nanoGPT's ``train.bin`` is uint16), memory-mapped by the runtime
(``zdsl/runtime/data/tokens.py``). The checker reads only its size: a whole number of tokens, and
at least one window of ``context + 1`` of them; the runtime proves every id below the vocab."""
from __future__ import annotations

import os
from pathlib import Path

from zdsl.check.values import Reader
from zdsl.lang import ast
from zdsl.lang.include import path_exists, resolve_relative
from zdsl.schedule import DataSpec, Span
from zdsl.sources.base import DataSource, SourceCall

# A token's integer type -> its bytes.
TOKEN_DTYPES = {"uint16": 2, "uint32": 4}
DEFAULT_DTYPE = "uint16"


class TokensSource(DataSource):
    kind = "tokens"
    settings = ("dtype", "context", "vocab")
    example = 'tokens("train.bin", dtype=uint16, context=64)'
    argument = "file"
    vocab_from_model = True
    bare = ("dtype",)

    def resolve(self, given: str, span: Span, report: Reader) -> str | None:
        path = Path(resolve_relative(given, span.file)).expanduser()
        if path_exists(path, "file") and os.access(path, os.R_OK):
            return str(path.resolve())
        why = "is a folder, not a file" if path_exists(path) and path.is_dir() \
            else "cannot be read" if path_exists(path) else "not found"
        report.error(span, f"token file {why}: {path}",
                     hint="a path relative to the schedule's folder to a flat file of token ids "
                          "(nanoGPT's prepare.py writes train.bin)")
        return None

    def read_setting(self, name: str, arg: ast.Arg, spec: DataSpec, at: SourceCall) -> None:
        if name != "dtype":
            super().read_setting(name, arg, spec, at)
            return
        spec.dtype = at.report.choice(arg.value, "token dtype", tuple(TOKEN_DTYPES))
        at.span("dtype", arg.span)

    def finish(self, spec: DataSpec, given: dict[str, ast.Arg], at: SourceCall) -> DataSpec:
        if "dtype" not in given:
            spec.dtype = DEFAULT_DTYPE
        if spec.source is not None and spec.dtype is not None and at.source_span is not None:
            at.length = whole_tokens(spec.source, spec.dtype, at.source_span, at.report)
        return spec

    def user_model_example(self) -> str:
        return self.example.replace(")", ", vocab=256)")

    def check_length(self, spec: DataSpec, at: SourceCall, spans: dict[str, Span]) -> None:
        """A window is context+1 tokens: the file must hold at least one."""
        count, context = at.length, spec.args.get("context")
        if count is None or context is None or count >= context + 1:
            return
        at.report.error(spans.get(f"{at.key}.context") or spans.get(at.key),
                        f"token file {spec.source} holds {count} tokens; context={context} needs at "
                        f"least {context + 1} (a window of context+1 tokens)",
                        hint=f"a shorter context (at most {count - 1}) or a longer file")

    def written(self, spec: DataSpec) -> tuple[str | None, list[tuple[str, object]]]:
        settings = list(spec.args.items())
        if spec.dtype:
            settings.insert(0, ("dtype", spec.dtype))
        return super().written(spec)[0], settings


def whole_tokens(path: str, dtype: str, span: Span, report: Reader) -> int | None:
    """The file's token count; an error where its size is not a whole number of tokens."""
    size, width = os.path.getsize(path), TOKEN_DTYPES[dtype]
    if size == 0:
        report.error(span, f"token file {path} is empty (0 bytes)", hint="regenerate it (nanoGPT: python prepare.py)")
        return None
    if size % width:
        other = [d for d, w in TOKEN_DTYPES.items() if size % w == 0 and d != dtype]
        report.error(span, f"token file {path} holds {size} bytes, not a whole number of {dtype} "
                           f"tokens ({width} bytes each)",
                     hint=(f"is it dtype={other[0]}? " if other else "")
                          + "a file cut short by an interrupted write ends in part of a token")
        return None
    return size // width


SOURCE = TokensSource()
