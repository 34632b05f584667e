"""Conformance checks a plugin author runs against their own implementation.

    from ember.testing import check_backend
    check_backend(MyBackend)   # AssertionError naming the first broken rule
"""

from ember.testing.backend_conformance import check_attention, check_backend, check_backend_basics

__all__ = ["check_attention", "check_backend", "check_backend_basics"]
