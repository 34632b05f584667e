"""Model architectures Ember implements itself, and the contract they follow."""

from ember.models.base import BaseCausalLM, KVCacheSpec

__all__ = ["BaseCausalLM", "KVCacheSpec"]
