"""An Ember hardware backend template (see README.md)."""
