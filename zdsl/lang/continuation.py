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
is reported where it was opened, not where the parser ran out of tokens.
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
                    continue
            elif tok.type == "LPAR":
                state.open.append(tok)
            elif tok.type == "RPAR" and state.open:
                state.open.pop()
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
        if state.joined_after < paren.line:
            return None       # every dropped line end came before this '(' opened
        if found.type == "$END":
            return paren
        previous = state.before if found is state.last else state.last
        if previous is not None and previous.line < found.line:
            return paren
        return None
