"""LoRA adapters as `ember serve` takes them at start: vLLM's ``--lora-modules`` (``NAME=PATH``
or a JSON object ``{"name", "path", "base_model_name"}``), ``EMBER_LORA_MODULES``, and TGI's
``LORA_ADAPTERS`` (comma-separated ``NAME=PATH`` or Hub ids, each then named by its id).
`add_lora_arguments` adds the flags (--enable-lora, --lora-modules, --max-loras,
--max-lora-rank, --max-cpu-loras, --enable-lora-runtime-updates) to `ember serve`.
Standard library only: the CLI parses these before anything heavy is imported. The routes
that load, unload and select adapters are `ember.api.routes.lora`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRAModule:
    """One adapter to load at start: its name (what requests select it by), a local
    directory or Hub id, and (vLLM's JSON form) the base model /v1/models names as its parent."""

    name: str
    path: str
    base_model_name: str | None = None


def _check_adapter_name(name: object, source: str) -> None:
    """The engine's rule for a name (`ember.engine.adapters.check_adapter_name`), said
    before anything loads."""
    if not isinstance(name, str) or not name or len(name) > 200 or any(c.isspace() for c in name):
        raise ValueError(f"{source}: an adapter name must be a non-empty string without spaces "
                         f"(at most 200 characters), got {name!r}")


def parse_lora_module(text: str, source: str = "--lora-modules") -> LoRAModule:
    """vLLM's two forms: ``NAME=PATH``, or a JSON object ``{"name": ..., "path": ...
    [, "base_model_name": ...]}``; ValueError naming ``source`` and the text."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source} {text!r} is not valid JSON ({exc.msg})") from None
        unknown = sorted(set(value) - {"name", "path", "base_model_name"}) if isinstance(value, dict) else []
        if not isinstance(value, dict) or unknown or not all(isinstance(value.get(k), str) for k in ("name", "path")):
            raise ValueError(f"{source} {text!r}: expected a JSON object with string fields name and path "
                             f"(and optionally base_model_name)" + (f"; unknown fields: {unknown}" if unknown else ""))
        base = value.get("base_model_name")
        if base is not None and (not isinstance(base, str) or not base):
            raise ValueError(f"{source} {text!r}: base_model_name must be a non-empty string")
        module = LoRAModule(value["name"], value["path"], base)
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"{source} {text!r}: expected NAME=PATH (a directory or Hub id) or a JSON object "
                             '{"name": ..., "path": ...}')
        module = LoRAModule(name.strip(), path.strip())
    _check_adapter_name(module.name, f"{source} {text!r}")
    if not module.path:
        raise ValueError(f"{source} {text!r}: the path of adapter {module.name!r} is empty")
    return module


def parse_lora_modules(text: str, source: str = "EMBER_LORA_MODULES") -> list[LoRAModule]:
    """The variable's value: a JSON array (of ``NAME=PATH`` strings or objects), one JSON
    object, or ``NAME=PATH`` entries separated by spaces, as on the command line."""
    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not valid JSON ({exc.msg})") from None
        if not all(isinstance(item, (str, dict)) for item in items):
            raise ValueError(f"{source}: expected a JSON array of NAME=PATH strings or {{name, path}} objects")
        return [parse_lora_module(item if isinstance(item, str) else json.dumps(item), source) for item in items]
    if text.startswith("{"):
        return [parse_lora_module(text, source)]
    return [parse_lora_module(item, source) for item in text.split()]


def parse_lora_adapters(text: str, source: str = "LORA_ADAPTERS") -> list[LoRAModule]:
    """TGI's variable: comma-separated entries, each ``NAME=PATH`` or a Hub id alone
    (the adapter is then named by its id, as TGI names it)."""
    modules = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if "=" in entry:
            modules.append(parse_lora_module(entry, source))
        else:
            _check_adapter_name(entry, f"{source} entry {entry!r}")
            modules.append(LoRAModule(entry, entry))
    return modules


def lora_modules(value: Any) -> tuple[LoRAModule, ...]:
    """`ServerSettings.lora_modules` from `LoRAModule`s, (name, path) pairs or a mapping."""
    items = list(value.items()) if isinstance(value, Mapping) else list(value or ())
    modules = []
    for item in items:
        if not isinstance(item, LoRAModule):
            if isinstance(item, str) or len(item) != 2:
                raise ValueError(f"--lora-modules: expected NAME=PATH entries, got {item!r}")
            item = LoRAModule(*item)
        _check_adapter_name(item.name, "--lora-modules")
        if not isinstance(item.path, str) or not item.path:
            raise ValueError(f"--lora-modules: the path of adapter {item.name!r} is empty")
        modules.append(item)
    names = [m.name for m in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules / LORA_ADAPTERS name the adapter(s) {', '.join(map(repr, twice))} "
                         "more than once: give each adapter one name")
    return tuple(modules)


def _lora_module_argument(text: str) -> LoRAModule:
    try:
        return parse_lora_module(text, "value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """`ember serve`'s LoRA options (each with its EMBER_* variable: `ember.api.cli_env`)."""
    group = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    group.add_argument(
        "--enable-lora", action="store_true", default=None,
        help="serve LoRA adapters beside the base model (implied by --lora-modules) [EMBER_ENABLE_LORA]",
    )
    group.add_argument(
        "--lora-modules", metavar="NAME=PATH", type=_lora_module_argument, nargs="+", action="extend", default=None,
        help="adapters to load at start, each NAME=PATH (a directory or Hub id) or vLLM's JSON form "
        "'{\"name\": NAME, \"path\": PATH, \"base_model_name\": BASE}'; requests select one by its NAME "
        "(repeatable) [EMBER_LORA_MODULES, space-separated or a JSON array; TGI's LORA_ADAPTERS adds "
        "comma-separated NAME=PATH or Hub ids]",
    )
    group.add_argument(
        "--max-loras", metavar="N", type=int, default=None,
        help="adapters whose requests run at once (others wait for a slot; default 1) [EMBER_MAX_LORAS]",
    )
    group.add_argument(
        "--max-lora-rank", metavar="R", type=int, default=None,
        help="highest adapter rank accepted (default 16) [EMBER_MAX_LORA_RANK]",
    )
    group.add_argument(
        "--max-cpu-loras", metavar="N", type=int, default=None,
        help="adapters kept read in host memory, least recently used dropped (default: --max-loras) "
        "[EMBER_MAX_CPU_LORAS]",
    )
    group.add_argument(
        "--lora-dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None,
        help="the adapters' weights in the model (vLLM's flag): auto is the compute dtype, bfloat16 beside "
        "quantized weights computed in float32 (the default model's) [EMBER_LORA_DTYPE]",
    )
    group.add_argument(
        "--enable-lora-runtime-updates", action="store_true", default=None,
        help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key; vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING) [EMBER_ENABLE_LORA_RUNTIME_UPDATES]",
    )
