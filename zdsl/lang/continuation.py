"""Line continuation: where a line end does not end a statement.

A statement ends at a line end (the grammar's ``_NL``) except

- inside parentheses, as in Python: ``machine cpu(`` ... ``)`` over several lines;
- after a comma: a statement never ends with one, so ``train steps=30,`` continues
  on the next line (a comment may follow the comma).

:class:`Continuation` is lark's postlexer: it drops those ``_NL`` tokens before the
LALR parser sees them, so the grammar stays one statement per ``_NL`` and every
token keeps its own line and column. Braces (pipeline bodies) are not brackets
here: their statements end at line ends as ever.

For a syntax error it records which ``(`` was still open and whether a line end
was dropped inside it (:meth:`Continuation.unclosed`), so that an unclosed ``(``
is reported where it was opened, not where the parser ran out of tokens; and which
``,`` last continued a statement (:meth:`Continuation.trailing_comma`), so that a
stray comma that swallowed the next statement is reported at the comma.

:func:`statement_end` finds where a statement that went on over several lines ends in
the text: zdsl tune replaces all of its lines, an unclosed ``(`` hint names that line.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from lark import Token


@dataclass
class _State:
    """One parse's bookkeeping (lark shares the postlexer between parses)."""
    open: list[Token] = field(default_factory=list)   # the '(' not yet closed, innermost last
    last: Token | None = None                         # the last token passed to the parser
    before: Token | None = None                       # the one passed before it
    joined_after: int = 0                             # the line of the last line end dropped inside '('
    comma: Token | None = None                        # the last ',' that continued a statement
    after_comma: Token | None = None                  # the first token of the line it continued on


class Continuation:
    """lark postlexer: drop ``_NL`` inside parentheses and after a trailing comma."""

    always_accept = ("_NL",)     # the contextual lexer must still see line ends where the parser would not

    def __init__(self):
        self._local = threading.local()

    def process(self, stream):
        state = self._local.state = _State()
        for tok in stream:
            if tok.type == "_NL":
                if state.open:
                    state.joined_after = max(state.joined_after, tok.line)
                    continue
                if state.last is not None and state.last.type == "COMMA":
                    state.comma, state.after_comma = state.last, None
                    continue
            elif tok.type == "LPAR":
                state.open.append(tok)
            elif tok.type == "RPAR" and state.open:
                state.open.pop()
            if state.comma is state.last and state.after_comma is None and state.last is not None:
                state.after_comma = tok
            state.before, state.last = state.last, tok
            yield tok

    def unclosed(self, found: Token) -> Token | None:
        """The ``(`` to blame for a syntax error at ``found`` (lark's ``$END`` at the end of
        file): the innermost open one, when a line end was dropped inside it and ``found``
        starts a line (most likely the next statement, swallowed by the one left open)."""
        state: _State | None = getattr(self._local, "state", None)
        if state is None or not state.open:
            return None
        paren = state.open[-1]
        if state.joined_after < _line(paren):
            return None       # every dropped line end came before this '(' opened
        if found.type == "$END":
            return paren
        previous = state.before if found is state.last else state.last
        if previous is not None and _line(previous) < _line(found):
            return paren
        return None

    def trailing_comma(self, found: Token) -> tuple[Token, Token | None] | None:
        """The line-ending ``,`` to blame for a syntax error at ``found`` when the statement went on
        past it to ``found``'s line (or to the end of file), with the first token it went on to."""
        state: _State | None = getattr(self._local, "state", None)
        if state is None or state.comma is None:
            return None
        first = state.after_comma
        if found.type == "$END":
            return (state.comma, first) if first is None else None
        if first is not None and first.line == found.line:
            return state.comma, first
        return None


def _line(tok: Token) -> int:
    """A lexed token's line (lark's type allows none, for a token made by hand: 0 here)."""
    return tok.line if tok.line is not None else 0


def has_code(line: str) -> bool:
    """Whether a line holds more than blanks and a comment."""
    return bool(line.split("#", 1)[0].strip())


def statement_end(lines: list[str], first: int, next_start: int) -> int:
    """The last line (0-based) of the statement that starts on line ``first`` when what follows
    it starts on line ``next_start`` (``len(lines)``: the end of the text): the last line before
    that holds code, never before ``first``. The blank and comment lines between two statements
    belong to neither; the lines of a wrapped statement hold code up to its last."""
    last = next_start - 1
    while last > first and not has_code(lines[last]):
        last -= 1
    return last
