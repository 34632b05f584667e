"""Build the plugin manager: discover the `ember` entry points, load, register.

A plugin the user named (``required``) that fails to load, or whose declared plugin
API range (``EMBER_PLUGIN_API``, `ember.plugin.api_version`) excludes this Ember's,
raises :class:`PluginLoadError` naming it; one merely discovered is logged and skipped. ``disabled`` names are blocked (pluggy's ``set_blocked``) and never
imported.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata

import pluggy

from ember.plugin import hookspecs
from ember.plugin.api_version import api_range_problem
from ember.plugin.registry import Registries

logger = logging.getLogger(__name__)

_REGISTRATION_HOOKS = {
    "ember_register_backends": "backends",
    "ember_register_model_architectures": "model_architectures",
    "ember_register_logits_processors": "logits_processors",
    "ember_register_quantizers": "quantizers",
    "ember_register_speculators": "speculators",
    "ember_register_grammar_backends": "grammar_backends",
    "ember_register_tool_parsers": "tool_parsers",
    "ember_register_reasoning_parsers": "reasoning_parsers",
    "ember_register_adapter_kinds": "adapter_kinds",
}


class PluginLoadError(RuntimeError):
    """A plugin the user asked for could not be loaded."""


@dataclass(frozen=True)
class PluginInfo:
    name: str
    value: str  # "module:attr" of the entry point, or "<direct>"
    distribution: str | None
    version: str | None
    status: str  # "loaded", "blocked", "failed: ..."


class EmberPluginManager(pluggy.PluginManager):
    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.plugin_infos: list[PluginInfo] = []
        self.registries = Registries()

    def register_plugin(self, plugin: object, name: str, info: PluginInfo | None = None) -> None:
        """Register a plugin object directly (tests, embedding applications); PluginLoadError
        if its declared plugin API range excludes this Ember's."""
        problem = api_range_problem(plugin, name)
        if problem is not None:
            raise PluginLoadError(problem)
        self.register(plugin, name=name)
        self.plugin_infos.append(info or PluginInfo(name, "<direct>", None, None, "loaded"))
        self._register_into(name)

    def _register_into(self, plugin_name: str | None = None) -> None:
        """Run the registration hooks of one plugin (or all when None)."""
        for hook_name, attr in _REGISTRATION_HOOKS.items():
            registry = getattr(self.registries, attr)
            for impl in getattr(self.hook, hook_name).get_hookimpls():
                if plugin_name is not None and impl.plugin_name != plugin_name:
                    continue
                registry._current_plugin = impl.plugin_name
                try:
                    impl.function(registry)
                finally:
                    registry._current_plugin = None


def _entry_points() -> list[metadata.EntryPoint]:
    return sorted(metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP), key=lambda e: e.name)


def create_plugin_manager(
    disabled: Iterable[str] = (),
    required: Iterable[str] = (),
    extra_plugins: Iterable[tuple[str, object]] = (),
) -> EmberPluginManager:
    """Load every `ember` entry point not in ``disabled``; fail loudly for ``required`` ones."""
    disabled = set(disabled)
    required = set(required)
    both = disabled & required
    if both:
        raise PluginLoadError(f"plugin(s) {sorted(both)} are both required and disabled")
    pm = EmberPluginManager()
    seen: set[str] = set()
    for ep in _entry_points():
        if ep.name in seen:  # the same distribution found twice on sys.path
            continue
        seen.add(ep.name)
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else None
        dist_version = dist.version if dist is not None else None
        if ep.name in disabled:
            pm.set_blocked(ep.name)
            pm.plugin_infos.append(PluginInfo(ep.name, ep.value, dist_name, dist_version, "blocked"))
            continue
        try:
            plugin = ep.load()
            problem = api_range_problem(plugin, ep.name)
            if problem is not None:
                if ep.name in required:
                    raise PluginLoadError(problem)
                logger.warning("%s; skipping it", problem)
                pm.plugin_infos.append(PluginInfo(ep.name, ep.value, dist_name, dist_version, f"skipped: {problem}"))
                continue
            pm.register(plugin, name=ep.name)
            pm._register_into(ep.name)
        except PluginLoadError:
            raise
        except Exception as exc:  # a broken third-party plugin must not take Ember down
            if pm.has_plugin(ep.name):
                pm.unregister(name=ep.name)
            for registry in pm.registries.all().values():
                registry.remove_owner(ep.name)
            message = f"plugin {ep.name!r} ({ep.value}, from {dist_name} {dist_version}) failed to load: {exc!r}"
            if ep.name in required:
                raise PluginLoadError(message) from exc
            logger.warning("%s; skipping it", message)
            pm.plugin_infos.append(
                PluginInfo(ep.name, ep.value, dist_name, dist_version, f"failed: {exc!r}")
            )
            continue
        pm.plugin_infos.append(PluginInfo(ep.name, ep.value, dist_name, dist_version, "loaded"))
    for name, plugin in extra_plugins:
        pm.register_plugin(plugin, name)
    missing = required - {info.name for info in pm.plugin_infos if info.status == "loaded"}
    if missing:
        known = ", ".join(sorted(seen)) or "none"
        raise PluginLoadError(f"required plugin(s) {sorted(missing)} not found; discovered: {known}")
    return pm


def get_registries(disabled: Iterable[str] = ()) -> Registries:
    """Convenience: a fresh plugin manager's registries."""
    return create_plugin_manager(disabled=disabled).registries
