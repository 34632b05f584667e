"""How the engine fails, as its callers see it (a leaf: the engine, its parallel ranks
and the API raise and catch these without importing one another)."""


class EngineDeadError(RuntimeError):
    """The engine stopped; no request can be served."""


class EngineFatalError(RuntimeError):
    """A step failure after which the engine cannot go on (a parallel worker died):
    the engine stops instead of serving the next requests."""


class RequestAbortedError(RuntimeError):
    """The server ended the request before it finished (e.g. shutting down); the message says why."""
