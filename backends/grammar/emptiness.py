"""Whether a grammar's language is empty (``root ::= root``, ``root ::= "a" root``): no finite text matches it, so
a constrained request could never end and at some step no token would be allowed; and which of its rules match no
text (a request whose output enters one is stuck the same way). Read from the normalized EBNF xgrammar prints
(``str(grammar)``): a rule is productive when one of its alternatives is made only of strings, character classes,
productive rules and optional repetitions; the language is empty when ``root`` is not.

Text this reader does not know (a future xgrammar syntax, structural tags' dispatch) makes it answer "not empty":
the compile-time check that no token is allowed at the start (xgrammar_backend.py) still catches the plainest
cases there.
"""
from __future__ import annotations

import re
from typing import Any

_TOKEN = re.compile(r'''\s*(?:
    (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<rep>\{\s*\d+\s*(?:,\s*-?\d+\s*)?\}|[*+?])
  | (?P<look>\(=)
  | (?P<punct>[()|])
  | (?P<name>[A-Za-z_][\w.\-]*)
)''', re.VERBOSE)
_FULL_RANGE = re.compile(r"^\[\^\\0-\\U0010ffff\]$", re.IGNORECASE)  # a class that excludes every character


class _Unknown(Exception):
    pass


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    body = body.rstrip()
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if m is None or m.end() == pos:
            raise _Unknown(body[pos:pos + 20])
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _Parser:
    """expr := seq ('|' seq)*; seq := item*; item := atom rep?; atom := string | class | name | '(' expr ')'
    | '(=' expr ')' (a lookahead: it adds no text)."""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.t, self.i = tokens, 0

    def peek(self) -> tuple[str, str] | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def expr(self) -> Any:
        alts = [self.seq()]
        while self.peek() == ("punct", "|"):
            self.i += 1
            alts.append(self.seq())
        return ("alt", alts)

    def seq(self) -> Any:
        items = []
        while (tok := self.peek()) is not None and tok not in (("punct", "|"), ("punct", ")")):
            items.append(self.item())
        return ("seq", items)

    def item(self) -> Any:
        kind, text = self.t[self.i]
        self.i += 1
        if kind == "string":
            atom: Any = ("text",)
        elif kind == "cls":
            atom = ("empty",) if _FULL_RANGE.match(text) else ("text",)
        elif kind == "name":
            atom = ("rule", text)
        elif kind in ("punct", "look") and text in ("(", "(="):
            inner = self.expr()
            if self.peek() != ("punct", ")"):
                raise _Unknown("unbalanced parentheses")
            self.i += 1
            atom = ("text",) if kind == "look" else inner
        else:
            raise _Unknown(text)
        if (tok := self.peek()) is not None and tok[0] == "rep":
            self.i += 1
            rep = tok[1]
            if rep in ("*", "?") or re.match(r"\{\s*0\s*[,}]", rep):
                atom = ("text",)  # zero repetitions: productive whatever it repeats
        return atom


def _productive(node: Any, rules: set[str]) -> bool:
    kind = node[0]
    if kind == "text":
        return True
    if kind == "empty":
        return False
    if kind == "rule":
        return node[1] in rules
    if kind == "seq":
        return all(_productive(n, rules) for n in node[1])
    return any(_productive(n, rules) for n in node[1])  # alt


def unproductive_rules(ebnf: str) -> list[str] | None:
    """The rules of the grammar no finite text matches (``ebnf``: xgrammar's normalized print of it), in the
    grammar's order; [] when every rule can end, None when the text has syntax this reader does not know."""
    try:
        trees: dict[str, Any] = {}
        for line in ebnf.splitlines():
            if not line.strip():
                continue
            name, sep, body = line.partition(" ::= ")
            if not sep:
                raise _Unknown(line[:20])
            parser = _Parser(_tokens(body))
            tree = parser.expr()
            while parser.peek() is not None and parser.peek()[0] == "look":  # the rule's trailing lookahead
                parser.item()
            if parser.peek() is not None:
                raise _Unknown("trailing text")
            trees[name.strip()] = tree
    except _Unknown:
        return None
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, tree in trees.items():
            if name not in productive and _productive(tree, productive):
                productive.add(name)
                changed = True
    return [name for name in trees if name not in productive]


def language_is_empty(ebnf: str, root: str = "root") -> bool:
    """True when no finite text matches the grammar."""
    return root in (unproductive_rules(ebnf) or [])
