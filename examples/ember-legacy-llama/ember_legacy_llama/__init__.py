"""An example Ember plugin, kept as small as a plugin can be. See README.md."""

__version__ = "0.1.0"
