"""Malformed model files end in one clear error naming the file, never a traceback.

Each damaged file is handed to the real command line (`ember.api.cli.main`, in
process, and once as the installed `ember` script): it must exit 2 with
``ember: error: <file>: <what is wrong>``. The loaders raise
`InvalidCheckpointError` (a `ValueError`), which is what the CLI maps to exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tiny_models import make_tiny_model

from ember.api.cli import main
from ember.models.loader import load_hf_config
from ember.weights import InvalidCheckpointError, convert_gguf_to_hf, iter_safetensors


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A loadable tiny Llama (config, tokenizer, model.safetensors); copy it before damaging it."""
    out = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama", out)
    return out


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "ember-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.delenv("EMBER_MODEL_ID", raising=False)


def damaged_copy(tiny_dir: Path, tmp_path: Path, name: str, content: bytes) -> tuple[Path, Path]:
    """A copy of the tiny model whose `name` holds `content`; returns (model dir, damaged file)."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    (model_dir / name).write_bytes(content)
    return model_dir, model_dir / name


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    status = main(["--log-level", "warning", *argv])  # info lines would precede the error
    return status, capsys.readouterr().err


def assert_clean_error(status: int, err: str, path: Path, match: str) -> None:
    assert status == 2, err
    assert err.startswith("ember: error: "), err
    assert "Traceback" not in err
    assert str(path) in err, err
    assert match.lower() in err.lower(), err


# --- safetensors ---------------------------------------------------------------------------------


def _header(entries: dict) -> bytes:
    header = json.dumps(entries).encode()
    return struct.pack("<Q", len(header)) + header


def _good_safetensors(tmp_path: Path) -> bytes:
    path = tmp_path / "good.safetensors"
    save_file({"a": torch.arange(16, dtype=torch.float32)}, str(path))
    return path.read_bytes()


SAFETENSORS_CASES = {
    "empty": (lambda good: b"", "is empty"),
    "shorter than the length field": (lambda good: b"\x01\x02\x03", "3 bytes"),
    "truncated in the data": (lambda good: good[:-10], "truncated"),
    "truncated in the header": (lambda good: good[:20], "truncated"),
    "huge header length": (lambda good: struct.pack("<Q", 2**60) + b"{}", "truncated"),
    "header not JSON": (lambda good: struct.pack("<Q", 5) + b"hello", "not valid JSON"),
    "header not an object": (lambda good: struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    "offsets past the data": (
        lambda good: _header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 100]}}) + bytes(16),
        "truncated",
    ),
    "offsets not a pair": (
        lambda good: _header({"a": {"dtype": "F32", "shape": [4], "data_offsets": "x"}}) + bytes(16),
        "'a'",
    ),
    "offsets that disagree with the shape": (
        lambda good: _header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}) + bytes(16),
        "not a valid safetensors file",
    ),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_damaged_safetensors_is_a_clear_error(tiny_dir, tmp_path, capsys, case):
    make, match = SAFETENSORS_CASES[case]
    model_dir, bad = damaged_copy(tiny_dir, tmp_path, "model.safetensors", make(_good_safetensors(tmp_path)))
    with pytest.raises(InvalidCheckpointError) as excinfo:
        list(iter_safetensors(model_dir))
    assert str(bad) in str(excinfo.value) and isinstance(excinfo.value, ValueError)
    status, err = run_cli(["generate", "hi", "--model-id", str(model_dir), "--max-tokens", "1"], capsys)
    assert_clean_error(status, err, bad, match)


def test_damaged_shard_is_refused_before_any_tensor_is_read(tmp_path):
    """Every file's header is checked when `iter_safetensors` is called, not when its turn comes."""
    save_file({"a": torch.ones(2)}, str(tmp_path / "part-a.safetensors"))
    (tmp_path / "part-b.safetensors").write_bytes(b"")
    with pytest.raises(InvalidCheckpointError, match="part-b.safetensors.*is empty"):
        iter_safetensors(tmp_path)


def test_index_that_is_not_json(tiny_dir, tmp_path, capsys):
    model_dir, index = damaged_copy(tiny_dir, tmp_path, "model.safetensors.index.json", b"{not json")
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00001.safetensors")
    status, err = run_cli(["generate", "hi", "--model-id", str(model_dir)], capsys)
    assert_clean_error(status, err, index, "not a valid safetensors index")


@pytest.mark.parametrize(
    "weight_map",
    [["a"], {"a": 5}, {"a": None}, {"a": ["x.safetensors"]}, "model.safetensors"],
    ids=["list", "number", "null", "shard-list", "string"],
)
def test_index_with_a_malformed_weight_map(tmp_path, weight_map):
    save_file({"a": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(InvalidCheckpointError, match="model.safetensors.index.json"):
        list(iter_safetensors(tmp_path))


def test_config_that_is_not_json(tiny_dir, tmp_path, capsys):
    model_dir, config = damaged_copy(tiny_dir, tmp_path, "config.json", b'{"model_type": "llama",\n  oops}')
    with pytest.raises(InvalidCheckpointError, match=r"not valid JSON.*line 2 column 3"):
        load_hf_config(model_dir)
    status, err = run_cli(["generate", "hi", "--model-id", str(model_dir)], capsys)
    assert_clean_error(status, err, config, "valid JSON")  # the tokenizer may read it first


def test_config_that_is_not_an_object(tiny_dir, tmp_path):
    model_dir, config = damaged_copy(tiny_dir, tmp_path, "config.json", b"[1, 2]")
    with pytest.raises(InvalidCheckpointError, match="not a JSON object") as excinfo:
        load_hf_config(model_dir)
    assert str(config) in str(excinfo.value)


@pytest.mark.parametrize("content, words", [
    (b"{not json", "not valid JSON"),
    (b'{"eos_token_id": "two"}', "eos_token_id must be a token id"),
    (b'{"eos_token_id": [1, -2]}', "eos_token_id must be a token id"),
])
def test_generation_config_that_is_damaged(tiny_dir, tmp_path, capsys, content, words):
    model_dir, bad = damaged_copy(tiny_dir, tmp_path, "generation_config.json", content)
    status, err = run_cli(["generate", "hi", "--model-id", str(model_dir)], capsys)
    assert_clean_error(status, err, bad, words)


def test_serve_with_a_damaged_model_exits_2_before_listening(tiny_dir, tmp_path, capsys):
    model_dir, bad = damaged_copy(tiny_dir, tmp_path, "model.safetensors", b"")
    status, err = run_cli(["serve", "--model-id", str(model_dir), "--port", "1"], capsys)
    assert_clean_error(status, err, bad, "is empty")


def test_installed_script_exits_2_on_a_damaged_model(tiny_dir, tmp_path):
    model_dir, bad = damaged_copy(tiny_dir, tmp_path, "model.safetensors", b"\0" * 7)
    script = Path(sys.executable).with_name("ember")
    command = str(script) if script.exists() else shutil.which("ember")
    assert command, "the `ember` console script is not installed: pip install -e ."
    result = subprocess.run(
        [command, "--log-level", "warning", "generate", "--model-id", str(model_dir), "hi"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "EMBER_BACKEND_OPTIONS": '{"native": false}'},
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("ember: error: ") and str(bad) in result.stderr, result.stderr


# --- GGUF ------------------------------------------------------------------------------------------


def _good_gguf(tmp_path: Path) -> bytes:
    path = tmp_path / "good.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _with_counts(good: bytes, num_tensors: int | None = None, num_kv: int | None = None) -> bytes:
    magic, version, tensors, kv = struct.unpack_from("<4sIQQ", good)
    header = struct.pack("<4sIQQ", magic, version, num_tensors if num_tensors is not None else tensors,
                         num_kv if num_kv is not None else kv)
    return header + good[24:]


GGUF_CASES = {
    "empty": (lambda good: b"", "is empty"),
    "random bytes": (lambda good: np.random.default_rng(0).bytes(4096), "not a GGUF file"),
    "wrong magic": (lambda good: b"GGML" + good[4:], "not a GGUF file"),
    "unknown version": (lambda good: good[:4] + struct.pack("<I", 99) + good[8:], "version 99"),
    "truncated in the header": (lambda good: good[:20], "truncated"),
    "truncated in the metadata": (lambda good: good[:60], "truncated"),
    "truncated in the tensor data": (lambda good: good[:-40], "truncated"),
    "magic only": (lambda good: b"GGUF", "truncated"),
    "absurd tensor count": (lambda good: _with_counts(good, num_tensors=2**62), "cannot fit"),
    "absurd metadata count": (lambda good: _with_counts(good, num_kv=2**62), "cannot fit"),
    "absurd tensor and metadata counts": (lambda good: _with_counts(good, 2**63, 2**63), "cannot fit"),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_damaged_gguf_is_a_clear_error(tmp_path, capsys, case):
    make, match = GGUF_CASES[case]
    bad = tmp_path / "model.gguf"
    bad.write_bytes(make(_good_gguf(tmp_path)))
    with pytest.raises(InvalidCheckpointError) as excinfo:
        convert_gguf_to_hf(bad, tmp_path / "out", progress=False)
    assert str(bad) in str(excinfo.value)
    assert not (tmp_path / "out").exists()
    status, err = run_cli(["generate", "hi", "--model-id", str(bad), "--max-tokens", "1"], capsys)
    assert_clean_error(status, err, bad, match)


def test_absurd_gguf_counts_never_reach_the_reader(tmp_path, monkeypatch):
    """The counts are checked against the file size before gguf.GGUFReader sizes anything by them."""
    bad = tmp_path / "model.gguf"
    bad.write_bytes(_with_counts(_good_gguf(tmp_path), num_tensors=2**62))

    def no_reader(*args, **kwargs):
        raise AssertionError("GGUFReader must not open a file whose counts cannot fit")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    with pytest.raises(InvalidCheckpointError, match=r"4611686018427387904 tensors"):
        convert_gguf_to_hf(bad, tmp_path / "out", progress=False)


def test_check_gguf_header_accepts_what_gguf_writes(tmp_path):
    """So the damaged cases above fail for their damage, not for the check."""
    from ember.weights.gguf_loader import check_gguf_header

    good = tmp_path / "good.gguf"
    good.write_bytes(_good_gguf(tmp_path))
    header = check_gguf_header(good)
    assert (header.version, header.num_tensors) == (3, 2) and header.num_kv >= 2
