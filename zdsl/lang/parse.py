"""Text to syntax tree: lark LALR parse, then a Transformer to :mod:`zdsl.lang.ast`.

Syntax errors are turned into positioned :class:`~zdsl.lang.errors.Diagnostic`
here and raised as :class:`~zdsl.lang.errors.ZsError`: what was found, what was
expected at that point (asked of the LALR parser itself), and for a
misspelt keyword the nearest one. Nothing in this module lets a Python
exception escape for any input text or bytes.
"""
from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from zdsl.lang import ast
from zdsl.lang.continuation import Continuation, statement_end
from zdsl.lang.errors import ZsError, did_you_mean, error
from zdsl.schedule import Span

MAX_SOURCE_BYTES = 4 << 20     # a schedule is a page of text; 4 MiB is certainly not one
_CONTINUATION = Continuation()  # the parser's postlexer: line ends inside '(' or after ',' continue

# How terminals are named in "expected ..." messages.
_TERMINAL_WORDS = {
    "NAME": "a name",
    "NUMBER": "a number",
    "STRING": 'a string ("...")',
    "_NL": "end of line",
    "$END": "end of file",
    "PHASE": "forward, backward or step",
    "AHEAD": "'units ahead'",
    "PREP": "from, to or on",
    "STEPS": "'steps'",
}


def grammar_text() -> str:
    """zs.lark from the installed package data, else from the source tree."""
    try:
        return importlib.resources.files("zdsl.grammar").joinpath("zs.lark").read_text("utf-8")
    except (ModuleNotFoundError, FileNotFoundError, OSError):
        return (Path(__file__).resolve().parents[2] / "grammar" / "zs.lark").read_text("utf-8")


@functools.lru_cache(maxsize=None)
def parser(strict: bool | None = None, cache: bool = True) -> Lark:
    """The LALR parser. Strict mode (no conflicts, no terminal collisions) needs
    the ``interegular`` package; without it the same grammar loads unchecked.
    The built tables are cached in the temp folder (keyed by the grammar's
    hash) so that ``zdsl check`` starts fast."""
    if strict is None:
        try:
            import interegular  # noqa: F401
            strict = True
        except ImportError:
            strict = False
    options = dict(parser="lalr", strict=strict, propagate_positions=True,
                   maybe_placeholders=True, postlex=_CONTINUATION)
    if cache:
        try:
            return Lark(grammar_text(), cache=True, **options)
        except Exception:   # noqa: BLE001 - an unusable cache only costs time
            pass
    return Lark(grammar_text(), **options)


# -- bytes to text --------------------------------------------------------------

def decode_source(data: bytes, file: str) -> str:
    """UTF-8 text of a schedule; a bad byte is a positioned error."""
    if len(data) > MAX_SOURCE_BYTES:
        raise ZsError([error(Span(file, 1, 1), f"file is {len(data)} bytes; a schedule must be "
                                               f"under {MAX_SOURCE_BYTES} bytes")])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = data[:exc.start].decode("utf-8", errors="replace")
        line = before.count("\n") + 1
        column = len(before) - (before.rfind("\n") + 1) + 1
        diag = error(Span(file, line, column, column + 1),
                     f"invalid UTF-8 byte 0x{data[exc.start]:02x}",
                     hint="save the file as UTF-8")
        diag.source_line = data.decode("utf-8", errors="replace").splitlines()[line - 1] \
            if data.decode("utf-8", errors="replace").splitlines() else ""
        raise ZsError([diag]) from None
    if text.startswith("\ufeff"):
        text = text[1:]   # a byte-order mark is not content
    return text


def read_source(path: str, at: Span | None = None) -> str:
    """The text of ``path``; a missing or unreadable file is an error at ``at``."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ZsError([error(at, f"cannot read {path}: {reason}")]) from None
    return decode_source(data, path)


# -- text to AST ----------------------------------------------------------------

def parse_text(text: str, file: str = "<string>") -> ast.Program:
    """Parse ``text``; raise ZsError with one positioned diagnostic on a syntax error."""
    if len(text) > MAX_SOURCE_BYTES:
        raise ZsError([error(Span(file, 1, 1), "schedule text is too long")])
    if text.startswith("\ufeff"):
        text = text[1:]   # a byte-order mark is not content
    try:
        tree = parser().parse(text)
    except UnexpectedInput as exc:
        diag = _syntax_error(exc, text, file)
        diag.source_line = _line(text, diag.span.line)
        raise ZsError([diag]) from None
    except LarkError as exc:   # pragma: no cover - lark's other errors are grammar bugs
        raise ZsError([error(Span(file, 1, 1), f"cannot parse: {exc}")]) from None
    try:
        statements = _ToAst(file).transform(tree)
    except VisitError as exc:
        if isinstance(exc.orig_exc, ZsError):
            for d in exc.orig_exc.diagnostics:
                d.source_line = _line(text, d.span.line) if d.span else None
            raise exc.orig_exc from None
        raise
    return ast.Program(file, text, statements)


def parse_file(path: str) -> ast.Program:
    return parse_text(read_source(path), path)


def _line(text: str, line: int) -> str:
    lines = text.splitlines()
    return lines[line - 1] if 1 <= line <= len(lines) else ""


def _end_position(text: str) -> tuple[int, int]:
    lines = text.split("\n")
    return len(lines), len(lines[-1]) + 1


def _expected_words(names) -> list[str]:
    terms = {t.name: t for t in parser().terminals}
    words = []
    for name in sorted(names):
        if name in _TERMINAL_WORDS:
            words.append(_TERMINAL_WORDS[name])
        elif name in terms and terms[name].pattern.type == "str":
            words.append(repr(terms[name].pattern.value))
        else:
            words.append(name.lower())
    return sorted(set(words), key=lambda w: (not w.startswith("'"), w))


def _keywords(names) -> list[str]:
    """The words a parser state would accept where a NAME was found (for did-you-mean)."""
    terms = {t.name: t for t in parser().terminals}
    out = []
    for name in names:
        if name == "PHASE":
            out += ["forward", "backward", "step"]
        elif name == "PREP":
            out += ["from", "to", "on"]
        elif name in terms and terms[name].pattern.type == "str" and terms[name].pattern.value.isalpha():
            out.append(terms[name].pattern.value)
    return out


def _accepted(exc: UnexpectedToken) -> set[str]:
    """What the parser would really accept here (LALR's expected set can over-approximate)."""
    try:
        accepts = exc.interactive_parser.accepts()
        if accepts:
            return set(accepts)
    except Exception:   # noqa: BLE001 - fall back to lark's own set
        pass
    return set(exc.expected or ())


def _syntax_error(exc: UnexpectedInput, text: str, file: str):
    if isinstance(exc, UnexpectedCharacters):
        pos = exc.pos_in_stream if exc.pos_in_stream is not None else -1
        ch = text[pos] if 0 <= pos < len(text) else ""
        span = Span(file, exc.line, exc.column, exc.column + 1)
        if ch == '"':
            return error(span, "unterminated string", hint='close the string with " on the same line')
        if ch == "\x00":
            return error(span, "unexpected NUL byte (\\0)", hint="the file looks binary")
        shown = repr(ch) if ch.isprintable() else f"U+{ord(ch):04X}" if ch else "end of file"
        expected = _expected_words(exc.allowed or ())
        return error(span, f"unexpected character {shown}",
                     hint=("expected " + _join(expected)) if expected else None)
    if isinstance(exc, UnexpectedToken):
        tok: Token = exc.token
        stray = _CONTINUATION.trailing_comma(tok)
        if stray is not None and (stray[1] is None or str(stray[1]) in _STATEMENTS):
            comma, first = stray
            went_on = "the end of the file" if first is None else f"line {first.line}'s {str(first)!r}"
            return error(_at(file, comma), "a statement does not end with ','",
                         hint=f"remove this ','; with it the statement goes on to {went_on}")
        paren = _CONTINUATION.unclosed(tok)
        if paren is not None:
            return error(_at(file, paren), "'(' is never closed",
                         hint=_unclosed_hint(paren, tok, text))
        accepted = _accepted(exc)
        expected = _expected_words(accepted)
        if tok.type == "$END":
            line, col = _end_position(text)
            span = Span(file, line, col, col + 1)
            found = "end of file"
        else:
            span = _at(file, tok, whole=tok.type != "_NL")
            found = "end of line" if tok.type == "_NL" else repr(str(tok))
        hint = None
        starts = _starts_statement(accepted) and tok.type not in ("$END", "_NL")
        if tok.type in ("NAME", "NUMBER") or (tok.type not in ("$END", "_NL") and str(tok).isalpha()):
            hint = did_you_mean(str(tok), _keywords(accepted))
        if hint is None and starts and str(tok) in _PIPELINE_VERBS:
            hint = f"{tok} belongs inside a pipeline: forward unit u {{ ... }}"
        if hint is None and starts:
            hint = "a statement starts with one of: " + ", ".join(_STATEMENTS)
        if hint is None and expected:
            hint = "expected " + _join(expected)
        message = f"unknown statement {found}" if starts else f"unexpected {found}"
        return error(span, message, hint=hint)
    if isinstance(exc, UnexpectedEOF):
        line, col = _end_position(text)
        return error(Span(file, line, col, col + 1), "unexpected end of file",
                     hint="expected " + _join(_expected_words(exc.expected or ())))
    return error(Span(file, getattr(exc, "line", 1) or 1, getattr(exc, "column", 1) or 1),
                 f"syntax error: {exc}")


def _at(file: str, tok: Token, whole: bool = False) -> Span:
    """Where ``tok`` is: its first character, or ``whole`` its text on its line. lark types a
    token's position as optional; the lexer sets it on every token the parser reports."""
    line, column = tok.line or 1, tok.column or 1
    end = tok.end_column if whole and tok.end_line == tok.line and tok.end_column else column + 1
    return Span(file, line, column, end)


def _unclosed_hint(paren: Token, found: Token, text: str) -> str:
    """How to fix an unclosed '(' whose statement ran on to ``found``."""
    lines = text.splitlines()
    stop = len(lines) if found.type == "$END" else (found.line or 1) - 1
    last = statement_end(lines, (paren.line or 1) - 1, stop) + 1
    hint = f"close it with ')' at the end of line {last}"
    if found.type != "$END":
        hint += f", or end line {last} with ',' if the statement goes on to line {found.line}"
    return hint


_STATEMENTS = ("schedule", "model", "data", "train", "optimizer", "ranks", "zero", "shard", "secondary",
               "offload", "prefetch", "bucket", "overlap", "recompute", "persist", "memory",
               "machine", "link", "include", "checkpoint", "freeze", "eval", "forward", "backward", "step")
_PIPELINE_VERBS = ("gather", "scatter", "reduce", "read", "write", "copy", "compute", "free")


def _starts_statement(accepted: set[str]) -> bool:
    return "SCHEDULE" in accepted and "MODEL" in accepted


def _join(words: list[str], limit: int = 8) -> str:
    if len(words) > limit:
        words = words[:limit] + ["..."]
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + " or " + words[-1]


# -- parse tree to AST ----------------------------------------------------------

_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t", "r": "\r"}


@v_args(meta=True)
class _ToAst(Transformer):
    """lark tree -> zdsl.lang.ast nodes. Rule methods take (meta, children)."""

    def __init__(self, file: str):
        super().__init__(visit_tokens=False)
        self.file = file

    # spans
    def tspan(self, tok: Token) -> Span:
        at = _at(self.file, tok, whole=True)
        return Span(self.file, at.line, at.column, at.end_column if tok.end_line == tok.line else None)

    def mspan(self, meta) -> Span:
        if getattr(meta, "empty", True):
            return Span(self.file, 1, 1)
        end = meta.end_column if meta.end_line == meta.line else None
        return Span(self.file, meta.line, meta.column, end)

    def kspan(self, meta, keyword: str) -> Span:
        s = self.mspan(meta)
        return Span(s.file, s.line, s.column, s.column + len(keyword))

    def name(self, tok) -> ast.Name | None:
        return None if tok is None else ast.Name(str(tok), self.tspan(tok))

    def string(self, tok) -> ast.Str:
        raw = str(tok)[1:-1]
        out, i = [], 0
        while i < len(raw):
            c = raw[i]
            if c == "\\":
                nxt = raw[i + 1] if i + 1 < len(raw) else ""
                if nxt not in _ESCAPES:
                    col = tok.column + 1 + i
                    raise ZsError([error(Span(self.file, tok.line, col, col + 2),
                                         f"unknown escape \\{nxt} in a string",
                                         hint='escapes are \\\\, \\", \\n, \\t and \\r')])
                out.append(_ESCAPES[nxt])
                i += 2
            else:
                out.append(c)
                i += 1
        return ast.Str("".join(out), self.tspan(tok))

    # values
    def start(self, meta, children):
        return [c for c in children if c is not None]

    def number(self, meta, children):
        (tok,) = children
        return ast.Num(str(tok), self.tspan(tok))

    def neg_number(self, meta, children):
        (tok,) = children
        s = self.mspan(meta)
        return ast.Num("-" + str(tok), Span(self.file, s.line, s.column, self.tspan(tok).end_column))

    def str_value(self, meta, children):
        return self.string(children[0])

    def name_value(self, meta, children):
        return self.name(children[0])

    def tuple(self, meta, children):
        return ast.Tuple(list(children), self.mspan(meta))

    def keyword_arg(self, meta, children):
        key, value = children
        return ast.Arg(self.name(key), value, self.mspan(meta))

    def positional_arg(self, meta, children):
        (value,) = children
        return ast.Arg(None, value, self.mspan(meta))

    def args(self, meta, children):
        return list(children)

    def call(self, meta, children):
        callee_tok, args = children
        callee = self.string(callee_tok) if callee_tok.type == "STRING" else self.name(callee_tok)
        has_parens = self.mspan(meta).end_column != callee.span.end_column
        return ast.Call(callee, args or [], has_parens, self.mspan(meta))

    def pair(self, meta, children):
        io, phase = children
        return ast.Pair(self.name(io), self.name(phase), self.mspan(meta))

    def range(self, meta, children):
        first, last = children
        return ast.Range(first, last, self.mspan(meta))

    def budget(self, meta, children):
        tier, size = children
        return ast.Budget(self.name(tier), size, self.mspan(meta))

    # statements
    def _stmt(self, cls, keyword, meta, **fields):
        return cls(keyword, self.mspan(meta), self.kspan(meta, keyword), **fields)

    def schedule(self, meta, children):
        name, desc = children
        return self._stmt(ast.ScheduleStmt, "schedule", meta, name=self.name(name),
                          description=None if desc is None else self.string(desc))

    def model(self, meta, children):
        return self._stmt(ast.CallStmt, "model", meta, call=children[0])

    def data(self, meta, children):
        return self._stmt(ast.CallStmt, "data", meta, call=children[0])

    def optimizer(self, meta, children):
        return self._stmt(ast.CallStmt, "optimizer", meta, call=children[0])

    def machine(self, meta, children):
        return self._stmt(ast.CallStmt, "machine", meta, call=children[0])

    def link(self, meta, children):
        return self._stmt(ast.LinkStmt, "link", meta, args=children[0])

    def train(self, meta, children):
        return self._stmt(ast.TrainStmt, "train", meta, args=children[0])

    def ranks(self, meta, children):
        count, device, per_node, per_word = children
        return self._stmt(ast.RanksStmt, "ranks", meta, count=count, device=self.name(device),
                          per_node=per_node, per_word=self.name(per_word))

    def zero(self, meta, children):
        return self._stmt(ast.ZeroStmt, "zero", meta, stage=children[0])

    def shard(self, meta, children):
        *states, over = children
        return self._stmt(ast.ShardStmt, "shard", meta, states=[self.name(t) for t in states], over=over)

    def secondary(self, meta, children):
        state, over = children
        return self._stmt(ast.SecondaryStmt, "secondary", meta, state=self.name(state), over=over)

    def over(self, meta, children):
        kind, size = children
        return ast.Over(self.name(kind), size, self.mspan(meta))

    def offload(self, meta, children):
        state, target = children
        return self._stmt(ast.OffloadStmt, "offload", meta, state=self.name(state), target=target)

    def prefetch(self, meta, children):
        state, depth, ahead = children
        return self._stmt(ast.PrefetchStmt, "prefetch", meta, state=self.name(state), depth=depth,
                          ahead=ahead is not None)

    def bucket(self, meta, children):
        return self._stmt(ast.SizeStmt, "bucket", meta, size=children[0])

    def persist(self, meta, children):
        return self._stmt(ast.SizeStmt, "persist", meta, size=children[0])

    def overlap(self, meta, children):
        return self._stmt(ast.OverlapStmt, "overlap", meta, pairs=list(children))

    def recompute_named(self, meta, children):
        return self._stmt(ast.RecomputeStmt, "recompute", meta, mode=self.name(children[0]))

    def recompute_units(self, meta, children):
        return self._stmt(ast.RecomputeStmt, "recompute", meta, ranges=list(children))

    def memory(self, meta, children):
        return self._stmt(ast.MemoryStmt, "memory", meta, budgets=list(children))

    def include(self, meta, children):
        return self._stmt(ast.IncludeStmt, "include", meta, path=self.string(children[0]))

    def checkpoint(self, meta, children):
        every, _steps, directory, keep = children
        return self._stmt(ast.CheckpointStmt, "checkpoint", meta, every=every,
                          dir=self.string(directory), keep=keep)

    def pattern(self, meta, children):
        (tok,) = children
        return self.string(tok) if tok.type == "STRING" else ast.Str(str(tok), self.tspan(tok))

    def freeze(self, meta, children):
        return self._stmt(ast.FreezeStmt, "freeze", meta, patterns=list(children))

    def eval(self, meta, children):
        every, _steps, source, batches = children
        return self._stmt(ast.EvalStmt, "eval", meta, every=every, source=source, batches=batches)

    # pipelines
    def index_var(self, meta, children):
        return ast.Index(self.name(children[0]), 0, None, self.mspan(meta))

    def index_plus(self, meta, children):
        var, num = children
        return ast.Index(self.name(var), self._small_int(num), None, self.mspan(meta))

    def index_minus(self, meta, children):
        var, num = children
        return ast.Index(self.name(var), -self._small_int(num), None, self.mspan(meta))

    def index_absolute(self, meta, children):
        return ast.Index(None, 0, self._small_int(children[0]), self.mspan(meta))

    def _small_int(self, tok: Token) -> int:
        text = str(tok).replace("_", "")
        if not text.isdigit() or len(text) > 9:
            raise ZsError([error(self.tspan(tok), f"unit index {str(tok)!r} must be a whole "
                                                  "number below 1000000000")])
        return int(text)

    def ref(self, meta, children):
        state, index = children
        return ast.Target(self.name(state), index, self.mspan(meta))

    def unit(self, meta, children):
        (index,) = children
        return ast.Target(None, index, self.mspan(meta))

    def pipe_stmt(self, meta, children):
        verb, target, prep, tier = children
        return ast.PipeLine(self.name(verb), target, self.name(prep), self.name(tier),
                            self.mspan(meta))

    def pipeline(self, meta, children):
        phase, var, *body = children
        return ast.PipelineStmt(str(phase), self.mspan(meta), self.tspan(phase),
                                var=self.name(var), body=[b for b in body if b is not None])

