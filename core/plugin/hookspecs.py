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

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pluggy

if TYPE_CHECKING:
    from ember.plugin.registry import Registry

T = TypeVar("T")

PROJECT_NAME = "ember"
ENTRY_POINT_GROUP = "ember"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def ember_register_backends(registry: Registry) -> None:
    """Register hardware backends: ``registry.register("cpu", CPUBackend)``.

    Values are subclasses of :class:`ember.plugin.backend.BaseBackend`.
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

    Values are subclasses of :class:`ember.plugin.logits_processor.BaseLogitsProcessor`,
    registered under their ``name``; the engine builds one instance of each
    (``cls(LogitsProcessorContext)``) when it starts. A request switches a
    third-party processor on with ``SamplingParams(extra={name: parameters})``.
    """


@hookspec
def ember_register_quantizers(registry: Registry) -> None:
    """Register weight quantizers: ``registry.register(MyQuantizer.name, MyQuantizer)``.

    Values are subclasses of :class:`ember.plugin.quantizer.BaseQuantizer`; the engine builds
    the one that reads the checkpoint's ``quantization_config``, or the one named by
    ``EngineConfig.quantize`` (``--quantize``) for a float checkpoint
    (docs/quantization.md).
    """


@hookspec
def ember_register_speculators(registry: Registry) -> None:
    """Register speculators by name: subclasses of
    :class:`ember.plugin.speculator.BaseSpeculator` (docs/speculative.md)."""


@hookspec
def ember_register_grammar_backends(registry: Registry) -> None:
    """Register grammar-guided decoding backends: ``registry.register(MyBackend.name, MyBackend)``.

    Values are subclasses of :class:`ember.plugin.grammar.BaseGrammarBackend`; the engine
    builds one per tokenizer the first time a request asks for it (by
    ``SamplingParams.grammar_backend``, else ``EngineConfig.grammar_backend``) and
    compiles constraints on worker threads (docs/grammar.md).
    """


@hookspec
def ember_register_tool_parsers(registry: Registry) -> None:
    """Register tool-call parsers: ``registry.register(MyParser.name, MyParser)``.

    Values are subclasses of :class:`ember.plugin.tool_parser.BaseToolParser`; a chat with
    ``tool_choice: "auto"`` is read by the first one (by name) whose
    ``matches_template`` accepts the model's chat template (docs/grammar.md).
    """


@hookspec
def ember_register_reasoning_parsers(registry: Registry) -> None:
    """Register reasoning parsers: ``registry.register(MyParser.name, MyParser)``.

    Values are subclasses of :class:`ember.plugin.reasoning_parser.BaseReasoningParser`;
    ``ember serve --reasoning-parser NAME`` reads every chat answer with one, returning
    the reasoning as ``reasoning_content`` (docs/reasoning.md).
    """


@hookspec
def ember_register_adapter_kinds(registry: Registry) -> None:
    """Register adapter kinds: ``registry.register(MyKind.name, MyKind)``.

    Values are subclasses of :class:`ember.plugin.adapter.BaseAdapterKind`, each reading
    the adapters whose ``adapter_config.json`` names one of its ``peft_types``; Ember's
    own LoRA is one (docs/lora.md).
    """


@hookspec
def ember_configure(config: Any) -> None:
    """Called once with the engine's configuration after plugins are loaded and
    before the model loads. May inspect; must not mutate frozen configs."""


class RouteContext(ABC):
    """What a plugin's HTTP routes may use: the argument of `ember_api_routes`.

    The API layer implements it (core knows no HTTP library), so a plugin needs no
    ``ember.api`` import: the engine through `client`, the server's limits, and the
    helpers that make a plugin's route answer as the built-in ones do (the same JSON
    errors, the same strict body parsing, documented in /openapi.json).
    """

    @property
    @abstractmethod
    def client(self) -> Any:
        """The engine, an `ember.engine.client.EngineClient` (typed loosely here: the plugin
        contracts sit below the engine and import nothing of it): tokenizer, model facts, a
        plugin's own logits processor (``client.logits_processor(name)``)."""

    @property
    @abstractmethod
    def max_input_tokens(self) -> int:
        """--max-input-tokens: the longest prompt a request may send."""

    @property
    @abstractmethod
    def max_total_tokens(self) -> int:
        """--max-total-tokens: prompt plus generated tokens of one request, at most."""

    @abstractmethod
    def route(
        self, path: str, endpoint: Callable[[Any], Awaitable[Any]], *, methods: Sequence[str] = ("POST",),
        summary: str | None = None, tag: str = "Plugins", request_model: type | None = None,
    ) -> Any:
        """A route of the app (a ``starlette.routing.Route``) serving ``endpoint``.

        ``endpoint(request)`` is async and returns a response, or a JSON-able value
        sent as a 200 JSON body. An error it raises from `validation_error` or
        `read_body` is answered as the built-in routes answer it (TGI's
        ``{"error", "error_type"}``; OpenAI's shape under ``/v1/``); any other
        exception is a 500. ``summary``, ``tag`` and ``request_model`` (a pydantic
        model) describe it in /openapi.json (without a summary: its docstring's first line).
        """

    @abstractmethod
    async def read_body(self, request: Any, model: type[T]) -> T:
        """The request's JSON body validated as the pydantic ``model``, strictly (as the
        built-in routes read theirs); a 400, 415 or 422 error naming the problem otherwise."""

    @abstractmethod
    def validation_error(self, message: str, param: str | None = None) -> Exception:
        """The 422 error to raise for a bad field (``param``: its name)."""

    @abstractmethod
    def check_chars(self, text: str, input_name: str, max_tokens: int | None = None) -> None:
        """Raise a 422 for a text too long to fit ``max_tokens`` (default
        --max-input-tokens) whatever its tokens, without tokenizing it."""

    @abstractmethod
    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the API's preparation threads, off the event loop (tokenizing
        or scoring a long text must not hold up /health)."""


@hookspec
def ember_api_routes(context: RouteContext) -> list[Any]:
    """Return HTTP routes to add to the API app, made with ``context.route(...)``
    (see `RouteContext`: everything a route may use, so a plugin imports no ``ember.api``).

    Called once, when the API layer builds the HTTP app (``create_app``). Core only
    declares this hook; the API layer calls it. Each plugin's list is added after the
    built-in routes; a path that a built-in route already serves is an error. The
    watermark plugin adds ``POST /watermark/detect`` this way.
    """


@hookspec
def ember_request_finished(request_id: str, finish_reason: str | None, num_output_tokens: int) -> None:
    """Called once per request after it finished (stopped, hit a length, or aborted)."""
