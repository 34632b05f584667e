"""Ember's plugin system: one pluggy PluginManager over the `ember` entry-point group."""

from ember.plugin.hookspecs import hookimpl, hookspec
from ember.plugin.manager import PluginInfo, PluginLoadError, create_plugin_manager, get_registries
from ember.plugin.registry import Registries, Registry

__all__ = [
    "hookimpl",
    "hookspec",
    "PluginInfo",
    "PluginLoadError",
    "Registries",
    "Registry",
    "create_plugin_manager",
    "get_registries",
]
