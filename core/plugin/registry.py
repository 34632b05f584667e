"""Typed registries, one per plugin kind, filled by the registration hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> implementation, remembering which plugin registered each name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._owners: dict[str, str] = {}
        self._current_plugin: str | None = None

    def register(self, name: str, item: T) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items and self._items[name] is not item:
            raise ValueError(
                f"{self.kind} {name!r} is registered twice: by {self._owners[name]!r} "
                f"and by {self._current_plugin!r}"
            )
        self._items[name] = item
        self._owners[name] = self._current_plugin or "<direct>"

    def remove_owner(self, plugin_name: str) -> None:
        """Drop everything a plugin registered (it failed half-way)."""
        for name in [n for n, owner in self._owners.items() if owner == plugin_name]:
            del self._items[name], self._owners[name]

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "none"
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {known}") from None

    def owner(self, name: str) -> str:
        return self._owners[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class Registries:
    backends: Registry = field(default_factory=lambda: Registry("hardware backend"))
    model_architectures: Registry = field(default_factory=lambda: Registry("model architecture"))
    logits_processors: Registry = field(default_factory=lambda: Registry("logits processor"))
    quantizers: Registry = field(default_factory=lambda: Registry("quantizer"))
    speculators: Registry = field(default_factory=lambda: Registry("speculator"))
    grammar_backends: Registry = field(default_factory=lambda: Registry("grammar backend"))
    tool_parsers: Registry = field(default_factory=lambda: Registry("tool-call parser"))
    reasoning_parsers: Registry = field(default_factory=lambda: Registry("reasoning parser"))
    adapter_kinds: Registry = field(default_factory=lambda: Registry("adapter kind"))

    def all(self) -> dict[str, Registry]:
        return {
            "backends": self.backends,
            "model_architectures": self.model_architectures,
            "logits_processors": self.logits_processors,
            "quantizers": self.quantizers,
            "speculators": self.speculators,
            "grammar_backends": self.grammar_backends,
            "tool_parsers": self.tool_parsers,
            "reasoning_parsers": self.reasoning_parsers,
            "adapter_kinds": self.adapter_kinds,
        }
