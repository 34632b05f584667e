"""Errors raised while finding and reading model weights.

Each error is a subclass of the built-in exception a caller would naturally
catch (`ValueError` for bad input, `FileNotFoundError` for a missing file), so
code that does not know Ember's types still handles them sensibly.
"""

from __future__ import annotations

from typing import NamedTuple


class UnsafeCheckpointError(ValueError):
    """A directory holds only pickle checkpoints, which Ember refuses to unpickle."""


class InvalidCheckpointError(ValueError):
    """A model file (weights, index, config) is damaged or not what its name says; the message names it."""


class CheckpointNotFoundError(FileNotFoundError):
    """A directory holds no weight files Ember knows how to read."""


class UnsupportedArchitectureError(ValueError):
    """A GGUF file declares an architecture the converter does not handle."""


class ResolveAttempt(NamedTuple):
    """One place `resolve_model` looked, and why it did not yield a model."""

    place: str
    outcome: str


class ModelNotFoundError(ValueError):
    """No source could provide the requested model.

    `attempts` lists every place that was tried, in order; the message shows
    them and says what the user can do next.
    """

    def __init__(self, model_id: str, attempts: list[ResolveAttempt], advice: str = "") -> None:
        self.model_id = model_id
        self.attempts = tuple(attempts)
        lines = [f"Could not find model {model_id!r}. Tried:"]
        lines += [f"  - {a.place}: {a.outcome}" for a in self.attempts]
        if advice:
            lines.append(advice)
        super().__init__("\n".join(lines))


class DefaultModelUnavailableError(ModelNotFoundError):
    """The default model's GGUF could be neither found installed nor downloaded from PyPI."""
