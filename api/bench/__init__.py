"""`ember bench`: a load generator for any OpenAI-compatible server, and the same
figures for the in-process engine. See docs/bench.md.

Modules, one concern each:

- ``datasets``  what to send: random prompts, a synthetic chat set, a user's JSONL file
- ``arrivals``  when to send it: all at once, Poisson or gamma arrival times (seeded)
- ``client``    one streaming HTTP request (SSE) timed token by token
- ``serve``     drive a server: arrivals, concurrency cap, progress bar
- ``offline``   drive the in-process engine with the same requests and arrivals
- ``metrics``   per-request records -> throughput and latency figures (JSON)
- ``stats``     mean and percentiles
- ``plots``     latency CDFs and throughput over time (matplotlib, optional)
- ``report``    the text summary of a result, and the side-by-side table of several
- ``cli``       the ``ember bench`` subcommands
"""
