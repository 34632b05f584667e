"""The option groups several `ember` commands share (model and engine, backend,
sampling, plugins, watermark) and the argument types they parse with; `ember.api.cli`
assembles the commands from them. Standard library only, as the parser must be."""

from __future__ import annotations

import argparse

from ember.api.cli_env import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DTYPES,
    KV_CACHE_DTYPES,
    MODEL_IMPLS,
    parse_graph_sizes,
    parse_names,
)


def names_argument(values: str) -> list[str]:
    names = parse_names(values)
    if not names:
        raise argparse.ArgumentTypeError("expected a plugin name")
    return names


def origins_argument(values: str) -> list[str]:
    origins = parse_names(values)
    if not origins:  # an empty --cors-allow-origin allows nothing: say so rather than ignore it
        raise argparse.ArgumentTypeError("expected an origin (scheme://host[:port]) or *")
    return origins


def graph_sizes(text: str) -> tuple[int, ...]:
    try:
        return parse_graph_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class ExtendNames(argparse.Action):
    """Repeatable, comma-separated names: `--disable-plugin a --disable-plugin b,c`."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest) or []
        setattr(namespace, self.dest, current + values)


def add_plugin_arguments(parser: argparse.ArgumentParser, *, with_required: bool) -> None:
    parser.add_argument(
        "--disable-plugin", metavar="NAME", type=names_argument, action=ExtendNames, default=None,
        help="do not load this plugin (repeatable, or comma-separated) [EMBER_DISABLE_PLUGIN]",
    )
    if with_required:
        parser.add_argument(
            "--plugin", metavar="NAME", type=names_argument, action=ExtendNames, default=None,
            help="require this plugin: failing to load it is an error (repeatable) [EMBER_PLUGIN]",
        )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Model and engine options shared by commands that load a model."""
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model-id", metavar="M", default=None,
        help="model directory, .gguf file, or Hugging Face Hub id (org/name, or org/name:FILE.gguf for one GGUF "
        "file), taken from the HF cache or downloaded; default: SmolLM2-135M-Instruct [EMBER_MODEL_ID]",
    )
    group.add_argument("--revision", metavar="R", default=None, help="hub revision [EMBER_REVISION]")
    group.add_argument("--gguf-file", metavar="F", default=None,
                       help="the one GGUF file of the hub repo --model-id to fetch and load (as org/name:F)")
    group.add_argument("--dtype", choices=DTYPES, default=None, help="weights dtype (default auto) [EMBER_DTYPE]")
    group.add_argument(
        "--model-impl", choices=MODEL_IMPLS, default=None,
        help="which code runs the model: ember (native; refused when the architecture has none), transformers "
        "(the fallback through transformers' modeling code with Ember's paged attention), auto (default: native "
        "where it exists, else the fallback; docs/model-impl.md) [EMBER_MODEL_IMPL]",
    )
    group.add_argument(
        "--quantize", metavar="NAME", default=None,
        help="quantize a float checkpoint's weights at load: int8 (per channel), int4 (groups of 64), int4-g32, "
        "int4-g128; a quantized checkpoint (GPTQ, AWQ, compressed-tensors, bitsandbytes, fp8) is read as it is "
        "(docs/quantization.md) [EMBER_QUANTIZE]",
    )
    group.add_argument(
        "--dequantize", action="store_true", default=None,
        help="load quantized weights the backend has no kernel for as float weights instead of refusing them "
        "[EMBER_DEQUANTIZE]",
    )
    group.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
        help="the KV cache's dtype; auto (default): the backend's choice (cpu: float16 beside a quantized model's "
        "float32 compute, else the compute dtype) [EMBER_KV_CACHE_DTYPE]",
    )
    add_plugin_arguments(group, with_required=True)


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("backend")
    group.add_argument(
        "--backend-option", metavar="KEY=VALUE", action="append", default=None,
        help="set one of the hardware backend's options (repeatable; `ember backends options NAME` lists them, "
        "e.g. cpu: linear=plain); wins over the same key of EMBER_BACKEND_OPTIONS "
        "[EMBER_BACKEND_OPTIONS, a JSON object: '{\"linear\": \"plain\"}']",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", metavar="N", type=int, default=None,
        help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}) [EMBER_MAX_TOKENS]",
    )
    group.add_argument(
        "--temperature", metavar="T", type=float, default=None,
        help=f"{DEFAULT_TEMPERATURE:g} (the default) is greedy: the most likely token each step; "
        "higher samples more freely (1.0: the model's own distribution) [EMBER_TEMPERATURE]",
    )
    group.add_argument("--top-p", metavar="P", type=float, default=None, help="nucleus mass (default 1.0) [EMBER_TOP_P]")
    group.add_argument("--top-k", metavar="K", type=int, default=None, help="-1 disables (default) [EMBER_TOP_K]")
    group.add_argument("--seed", metavar="S", type=int, default=None, help="make sampling reproducible [EMBER_SEED]")


def add_watermark_arguments(parser: argparse.ArgumentParser, *, with_delta: bool) -> None:
    group = parser.add_argument_group("watermark (the watermark plugin)")
    group.add_argument("--watermark-key", metavar="KEY", default=None, help="secret key of the green lists [EMBER_WATERMARK_KEY]")
    group.add_argument("--watermark-gamma", metavar="G", type=float, default=None, help="green fraction (default 0.25) [EMBER_WATERMARK_GAMMA]")
    if with_delta:
        group.add_argument("--watermark-delta", metavar="D", type=float, default=None, help="bias added to green logits (default 2.0) [EMBER_WATERMARK_DELTA]")
