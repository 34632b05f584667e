"""Hook specifications: the documentation of every hook a plugin can implement.

Registration hooks are called once when the plugin manager is built; each
receives the typed registry of its kind and calls ``registry.register(name, obj)``.
Nothing per token goes through a hook: the engine resolves its backend, model
class and processors once and calls them directly.

A plugin is a module (or object) with functions decorated by ``@hookimpl``,
named by an entry point in the group ``ember``::

    [project.entry-points.ember]
    my_plugin = "my_package.ember_plugin"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from ember.plugin.registry import Registry

PROJECT_NAME = "ember"
ENTRY_POINT_GROUP = "ember"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def ember_register_backends(registry: Registry) -> None:
    """Register hardware backends: ``registry.register("cpu", CPUBackend)``.

    Values are subclasses of :class:`ember.backend.BaseBackend`.
    """


@hookspec
def ember_register_model_architectures(registry: Registry) -> None:
    """Register model classes by the architecture name in a model's ``config.json``
    (``"LlamaForCausalLM"``). Values are factories ``cls(hf_config, attention,
    compute_dtype) -> torch.nn.Module`` following :mod:`ember.models.base`.
    """


@hookspec
def ember_register_logits_processors(registry: Registry) -> None:
    """Register logits processors: ``registry.register(MyProcessor.name, MyProcessor)``.

    Values are subclasses of :class:`ember.logits_processor.BaseLogitsProcessor`,
    registered under their ``name``; the engine builds one instance of each
    (``cls(LogitsProcessorContext)``) when it starts. A request switches a
    third-party processor on with ``SamplingParams(extra={name: parameters})``.
    """


@hookspec
def ember_register_quantizers(registry: Registry) -> None:
    """Register weight quantizers by name (contract filled by a later issue)."""


@hookspec
def ember_register_speculators(registry: Registry) -> None:
    """Register speculative decoding methods by name (contract filled by a later issue)."""


@hookspec
def ember_register_grammar_backends(registry: Registry) -> None:
    """Register grammar-guided decoding backends by name (contract filled by a later issue)."""


@hookspec
def ember_configure(config: Any) -> None:
    """Called once with the engine's configuration after plugins are loaded and
    before the model loads. May inspect; must not mutate frozen configs."""


@hookspec
def ember_api_routes(service: Any) -> list[Any]:
    """Return HTTP routes (``starlette.routing.Route``) to add to the API app.

    Called once, when the API layer builds the HTTP app (``create_app``), with the
    app's ``GenerationService`` (``service.engine.engine`` is the ``LLMEngine``:
    tokenizer, logits pipeline; ``service.limits.payload_limit`` bounds request
    bodies). Core only declares this hook; the API layer calls it. Each plugin's list is added after the built-in routes; a path
    that a built-in route already serves is an error. The watermark plugin adds
    ``POST /watermark/detect`` this way.
    """


@hookspec
def ember_request_finished(request_id: str, finish_reason: str | None, num_output_tokens: int) -> None:
    """Called once per request after it finished (stopped, hit a length, or aborted)."""
