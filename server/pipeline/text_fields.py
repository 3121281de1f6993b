"""Every string a request carries is valid Unicode, checked once at the edge (issue #33).

JSON can carry a lone UTF-16 surrogate ("\\ud800"), which no tokenizer can encode and no response can echo as
UTF-8: left inside, it turns into a 500 wherever the string is next used (the model name in an error message, a
/generate rid after the whole generation ran, a tool description in the template). The request models of every
dialect (server/api/*/protocol.py) derive from ``CheckedText``: it walks every string field, dict key and list item
once, after validation, and the first bad one is a 400 naming its field.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, model_validator

from tierlm.runtime.errors import RequestError


def check_text(text: str, param: str) -> None:
    """400 for text that is not valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"{param} contains a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x} at character {e.start}), which "
            "is not valid Unicode; send the text as UTF-8, with surrogates only in valid pairs", 400,
            param=param, code="invalid_unicode") from None


_ID_FIELDS = frozenset({"prompt", "input_ids", "tokens"})  # fields that hold token ids (or texts)


def _join(param: str, key: str) -> str:
    return f"{param}.{key}" if param else key


def _all_valid(value: Any) -> bool:
    """Whether every string inside ``value`` is valid Unicode: the quick pass, no field names built; the naming
    walk runs only when this finds a bad string."""
    if isinstance(value, str):
        return value.isascii() or _encodes(value)
    if isinstance(value, BaseModel):
        return all(_is_ids(name, v) or _all_valid(v) for name, v in value.__dict__.items()) and \
            _all_valid(value.__pydantic_extra__ or {})
    if isinstance(value, Mapping):
        return all((not isinstance(k, str) or k.isascii() or _encodes(k)) and _all_valid(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_all_valid(v) for v in value)
    return True


def _is_ids(name: str, value: Any) -> bool:
    """A field of token ids (validated as integers): a million of them need no walk."""
    return name in _ID_FIELDS and isinstance(value, list) and bool(value) and not isinstance(value[0], str)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_strings(value: Any, param: str = "") -> None:
    """check_text on every string inside a request (pydantic models, their extra fields, dicts with their keys,
    lists), naming the field of the first bad one."""
    if _all_valid(value):
        return
    _name_the_bad_one(value, param)


def _name_the_bad_one(value: Any, param: str) -> None:
    if isinstance(value, str):
        check_text(value, param or "body")
    elif isinstance(value, BaseModel):
        for name, field in type(value).model_fields.items():
            item = getattr(value, name)
            if not _is_ids(name, item):
                _name_the_bad_one(item, _join(param, field.alias or name))
        for name, extra in (value.__pydantic_extra__ or {}).items():
            check_text(name, param or "body")
            _name_the_bad_one(extra, _join(param, name))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str):
                check_text(key, f"{param} (a key)" if param else "body")
            _name_the_bad_one(item, _join(param, str(key)))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _name_the_bad_one(item, f"{param}[{i}]")


class CheckedText(BaseModel):
    """A request body: every string in it is valid Unicode, checked once when it is parsed; the first that is not
    is a 400 naming its field (RequestError passes through pydantic untouched). Every dialect's request models
    derive from it."""

    @model_validator(mode="after")
    def _valid_unicode(self) -> Any:
        check_strings(self)
        return self
