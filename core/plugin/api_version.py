"""The plugin API's version, and whether a plugin's declared range admits it.

Everything a third party implements or calls lives in ``ember.plugin`` (the contracts,
hookspecs, registries), ``ember.models.base``/``ember.models.layers`` (architectures),
``ember.testing`` (the conformance checks) and the plain values (``ember.config``,
``ember.sampling_params``, ``ember.outputs``, ``ember.constraint``, ``ember.logprobs``,
``ember.errors``). `API_VERSION` versions that surface, semantically: docs/plugins.md says
what a minor release may and may not change.

A plugin module states the versions it supports as a PEP 440 specifier in a module
attribute, ``EMBER_PLUGIN_API = ">=1.0,<2"``; the plugin manager refuses one whose
range excludes `API_VERSION` (an error if the user named the plugin, else logged and
skipped). A plugin that states nothing is loaded as written for this major version.
"""

from __future__ import annotations

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

API_VERSION = "1.6.0"

#: the module attribute a plugin states its range in
RANGE_ATTRIBUTE = "EMBER_PLUGIN_API"


def api_range_problem(plugin: object, name: str) -> str | None:
    """Why ``plugin`` (a loaded plugin module or object) cannot run on this plugin API,
    or None when its declared range admits `API_VERSION` or it declares none."""
    declared = getattr(plugin, RANGE_ATTRIBUTE, None)
    if declared is None:
        return None
    try:
        supported = SpecifierSet(str(declared))
    except InvalidSpecifier:
        return f"plugin {name!r} declares {RANGE_ATTRIBUTE} = {declared!r}, which is not a version range (e.g. '>=1.0,<2')"
    if Version(API_VERSION) in supported:
        return None
    return (f"plugin {name!r} supports Ember plugin API {declared}, but this Ember provides plugin API "
            f"{API_VERSION} (docs/plugins.md: versions and what they promise)")
