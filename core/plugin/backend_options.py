"""Backend options: a backend's tuning knobs as typed, documented fields (part of the
backend contract, `ember.plugin.backend`). A backend declares ``options_class``, a
`BackendOptions` subclass whose fields are made with `option`; users set them by name
as strings (``--backend-option key=value``, ``EMBER_BACKEND_OPTIONS``,
``EngineConfig.backend_options``) and ``ember backends options NAME`` lists them."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("auto", "none")  # what an optional (``X | None``) option's None is spelled as


def option(default: Any, doc: str) -> Any:
    """A field of a `BackendOptions` subclass: its default and its documentation (what
    it trades, what the default does), which ``ember backends options NAME`` prints."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class OptionInfo:
    """One option as ``ember backends options`` lists it."""

    name: str
    type: str  # "int", "float", "bool", "str", "int or auto", or the choices "a|b|c"
    default: Any
    doc: str


@dataclass(frozen=True)
class BackendOptions:
    """A backend's tuning knobs: a frozen dataclass whose fields are made with
    `option` (a default and a doc each) and typed ``int``, ``float``, ``bool``, ``str``,
    a ``Literal`` of choices, or one of those ``| None``. Users set them by name, as
    strings (``ember serve --backend-option key=value``, ``EMBER_BACKEND_OPTIONS``,
    ``EngineConfig.backend_options``); `parse` converts and checks them. A subclass may
    check its values in ``__post_init__`` (ValueError). The base has no fields."""

    @classmethod
    def field_types(cls) -> dict[str, Any]:
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    @classmethod
    def describe(cls) -> list[OptionInfo]:
        """Every option: its name, type or choices, default and doc, in field order."""
        types_ = cls.field_types()
        return [
            OptionInfo(f.name, _type_name(types_[f.name]), f.default, f.metadata.get("doc", ""))
            for f in dataclasses.fields(cls)
        ]

    @classmethod
    def parse(cls, values: Mapping[str, Any] | None, backend: str = "backend") -> BackendOptions:
        """Options from ``{name: text}`` (values of the field's own type pass as they
        are); unset fields keep their defaults. ValueError naming ``backend``, the key,
        the bad value and what is allowed, for an unknown key or a malformed value."""
        if isinstance(values, cls):
            return values
        values = dict(values or {})
        types_ = cls.field_types()
        unknown = sorted(set(values) - set(types_))
        if unknown:
            allowed = ", ".join(types_) or "none: it has no options"
            raise ValueError(f"the {backend} backend has no option {unknown[0]!r}; its options: {allowed}")
        converted = {}
        for key, value in values.items():
            try:
                converted[key] = _convert(value, types_[key])
            except ValueError as exc:
                raise ValueError(f"the {backend} backend's option {key}={value!r} is invalid: {exc}") from None
        try:
            return cls(**converted)
        except ValueError as exc:
            raise ValueError(f"the {backend} backend's options: {exc}") from None

    def non_default(self) -> dict[str, Any]:
        """The options whose value differs from their default, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


def _optional(tp: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None``, else ``(tp, False)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _optional(tp)
    if typing.get_origin(inner) is Literal:
        name = "|".join(str(c) for c in typing.get_args(inner))
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or auto" if optional else name


def _convert(value: Any, tp: Any) -> Any:
    inner, optional = _optional(tp)
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in _NONE)):
        return None
    if typing.get_origin(inner) is Literal:
        choices = typing.get_args(inner)
        text = value.strip().lower() if isinstance(value, str) else value
        if text not in choices:
            raise ValueError(f"choose one of: {', '.join(map(str, choices))}" + (" (or auto)" if optional else ""))
        return text
    if inner is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"expected a boolean: one of {', '.join(_TRUE + _FALSE)}")
    if inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return int(str(value).strip())
        except ValueError:
            raise ValueError("expected an integer") from None
    if inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(str(value).strip())
        except ValueError:
            raise ValueError("expected a number") from None
    if inner is str:
        return str(value)
    raise ValueError(f"options of type {tp!r} cannot be set by name")
