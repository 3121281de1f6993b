"""Chat templates rendered in a guarded Jinja sandbox.

The environment is the one transformers renders chat templates in (``ImmutableSandboxedEnvironment`` with its
``tojson``, ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``, trim_blocks, loop controls,
``{% generation %}``), so a model's template renders the same text. Around it: a time limit and a bound on size,
checked at every call, attribute, operator, filter, loop step and output piece, so that no template (the model's,
the operator's, or one a trusted client sends) can hold a tokenizer thread or grow the server's memory. A render
over either limit raises RenderLimitError and the thread is free again.
"""
from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TIME_LIMIT_S = 10.0  # one render; a model's template renders a long conversation in milliseconds
_WIDTH = re.compile(r"\d+")


class RenderLimitError(jinja2.TemplateError):
    """A render ran past the time limit or grew past the size bound."""


class _Budget(threading.local):
    deadline: float | None = None
    max_chars: int = 0
    time_limit_s: float = TIME_LIMIT_S


_BUDGET = _Budget()


def _tick() -> None:
    deadline = _BUDGET.deadline
    if deadline is not None and time.monotonic() > deadline:
        raise RenderLimitError(f"rendering the chat template took longer than the {_BUDGET.time_limit_s:g} s limit")


def _check_size(n: int, what: str) -> None:
    if _BUDGET.deadline is not None and n > _BUDGET.max_chars:
        raise RenderLimitError(f"{what} of {n} would exceed the {_BUDGET.max_chars} characters a rendered prompt may "
                               "hold")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else 0


def _check_args(fn: Any, args: tuple, kwargs: dict) -> None:
    """Refuse, before it runs, a call whose arguments make it produce more than a prompt may hold: widths and
    counts (center(10**9), '%999999999s'), str.replace and join over many pieces."""
    for a in (*args, *kwargs.values()):
        if type(a) is int:
            _check_size(a, "a width or count")
    fn = getattr(fn, "__wrapped__", fn)  # the sandbox wraps str.format
    name = getattr(fn, "__name__", "")
    target = getattr(fn, "__self__", None)
    fmt = target if name in ("format", "format_map") else args[0] if name == "do_format" and args else None
    if isinstance(fmt, str):
        for w in _WIDTH.findall(fmt):
            _check_size(int(w), "a format width")
    if name == "expandtabs" and isinstance(target, str):
        tab = args[0] if args else kwargs.get("tabsize", 8)
        _check_size(len(target) + target.count("\t") * (tab if type(tab) is int else 8), "an expandtabs result")
    if name == "do_indent" and args and isinstance(args[0], str):  # every line gets the indent
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if type(width) is int else 4
        _check_size(len(args[0]) + args[0].count("\n") * width, "an indented string")
    if name in ("replace", "do_replace"):
        strs = [target] if isinstance(target, str) else []
        strs += [a for a in args if isinstance(a, str)]
        if len(strs) >= 3:
            s, old, new = strs[:3]
            count = s.count(old) if old else len(s) + 1
            _check_size(len(s) + count * max(0, len(new) - len(old)), "a replace result")
    if name in ("join", "do_join"):
        items = next((a for a in args if isinstance(a, (list, tuple))), None)
        if items is not None:
            sep = len(target) if isinstance(target, str) else 0
            _check_size(sum(_size(i) + sep for i in items), "a joined string")


def _guard_filter(fn: Any) -> Any:
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        _check_args(fn, args, kwargs)
        rv = fn(*args, **kwargs)
        _check_size(_size(rv), "a filter result")
        return rv
    return guarded


def _guarded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """Every {% for %} runs over this: a loop with an empty body still meets the clock."""
    for item in iterable:
        _tick()
        yield item


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    # the operators that can build a large value from small ones; a sandbox only intercepts those it is told
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        _tick()
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and type(n) is int:
                    _check_size(len(seq) * n, "a repeated value")
        elif op == "**" and type(left) is int and type(right) is int and right > 0:
            _check_size(left.bit_length() * right // 8, "a power's size in bytes")
        elif op == "%" and isinstance(left, str):
            for w in _WIDTH.findall(left):
                _check_size(int(w), "a format width")
        elif op == "+":
            _check_size(_size(left) + _size(right), "a concatenation")
        return super().call_binop(context, op, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's names
        _tick()
        _check_args(__obj, args, kwargs)
        rv = super().call(__context, __obj, *args, **kwargs)
        _check_size(_size(rv), "a call's result")
        return rv

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens with it (for training
    masks); rendering keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson: plain json.dumps (jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the templates' argument name
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` in a template, without the type's attributes (no way out through dict's class)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)``, refusing underscore names (no way into CPython internals through it)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's Namespace signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template namespace cannot hold {name!r}: names starting with "
                                                  "an underscore are refused")


@functools.lru_cache(maxsize=1)
def _environment() -> GuardedEnvironment:
    """transformers' chat-template environment (the same settings, filters and globals, so templates render the
    same text; tests/test_hardening_templates.py compares the two), with every filter guarded."""
    env = GuardedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace, _tierlm_iter=_guarded_iter)
    env.filters = {name: _guard_filter(fn) for name, fn in env.filters.items()}
    return env


@functools.lru_cache(maxsize=8)
def compile_template(text: str) -> jinja2.Template:
    """The template with every for-loop's iterable passed through _guarded_iter (raises TemplateSyntaxError)."""
    env = _environment()
    tree = env.parse(text)
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Call(nodes.Name("_tierlm_iter", "load"), [loop.iter], [], None, None)
    return env.from_string(tree)


def render(text: str, variables: dict[str, Any], max_chars: int, time_limit_s: float = TIME_LIMIT_S) -> str:
    """The rendered template; RenderLimitError past ``time_limit_s`` or ``max_chars`` characters, a
    jinja2.TemplateError (or another exception) for a template that refuses the input. Compiling is inside the
    limits too: jinja runs filters with constant arguments while it compiles."""
    _environment()  # built once, outside any one render's time
    _BUDGET.max_chars, _BUDGET.time_limit_s = max_chars, time_limit_s
    _BUDGET.deadline = time.monotonic() + time_limit_s
    try:
        template = compile_template(text)
        pieces: list[str] = []
        total = 0
        for piece in template.generate(**variables):
            total += len(piece)
            _check_size(total, "a rendered prompt")
            _tick()
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _BUDGET.deadline = None
