"""A safe, exact parser for countdown expressions: integers, + - * /, parentheses.

Never calls `eval`. Values are `Fraction`s, so `6/4*2 == 3` holds exactly. There is no unary
minus and no exponent, and input is capped in length, so values stay bounded and recursion
shallow.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_EXPR_CHARS = 64
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/()]))")  # ASCII digits only


class _Malformed(Exception):
    """Internal signal: the text is not a valid, evaluable expression."""


def _tokenize(text: str) -> list[str]:
    tokens, pos, text = [], 0, text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _Malformed
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    return tokens


class _Parser:
    """Recursive descent: expr := term (('+'|'-') term)*; term := atom (('*'|'/') atom)*;
    atom := NUMBER | '(' expr ')'."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos = tokens, 0
        self.literals: list[str] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise _Malformed
        self.pos += 1
        return tok

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Fraction:
        value = self.atom()
        while self.peek() in ("*", "/"):
            if self.take() == "*":
                value *= self.atom()
            else:
                divisor = self.atom()
                if divisor == 0:
                    raise _Malformed
                value /= divisor
        return value

    def atom(self) -> Fraction:
        tok = self.take()
        if tok == "(":
            value = self.expr()
            if self.take() != ")":
                raise _Malformed
            return value
        if tok[0].isdigit():
            self.literals.append(tok)
            return Fraction(int(tok))
        raise _Malformed


def parse_expression(text: str, *, max_chars: int = MAX_EXPR_CHARS) -> tuple[Fraction, list[str]] | None:
    """Evaluate `text` exactly; return (value, number literals as written) or None if malformed.

    Malformed: longer than `max_chars`, empty, any character other than digits, + - * / ( ) and
    whitespace, bad syntax (including unary minus), or division by zero.
    """
    if not isinstance(text, str) or len(text) > max_chars:
        return None
    try:
        tokens = _tokenize(text)
        if not tokens:
            return None
        parser = _Parser(tokens)
        value = parser.expr()
        if parser.pos != len(tokens):
            return None
        return value, parser.literals
    except _Malformed:
        return None
