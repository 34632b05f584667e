"""Grammar compiles isolated from serving (issue 35 item 1, docs/grammar.md).

Compiles run in worker processes: a compile past the timeout is killed and its worker
replaced, a compile over its memory limit is stopped, the compiled grammar comes back
to the engine and is cached; constraints over the size limits are refused before they
compile, with the limit and the flag named. `SpinningBackend` is a real grammar backend
(outlines with three constraints it cannot finish), registered in the plugin registry
as any plugin's backend is.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
from server_utils import running_server
from tiny_models import VOCAB_SIZE, byte_tokenizer

from ember.constraint import Constraint
from ember.engine.grammar_manager import GrammarManager
from ember.grammar_limits import GrammarLimits, check_constraint
from ember.plugin import create_plugin_manager
from ember.plugin.grammar import GrammarContext
from ember.plugins.grammar.outlines_backend import OutlinesBackend
from ember.sampling_params import SamplingParams
from ember.testing import check_grammar_backend

SPIN, HOG, PID = "spin forever", "take 8 GiB", "which process"


class SpinningBackend(OutlinesBackend):
    """outlines, but the regex SPIN compiles forever, HOG allocates 8 GiB, and PID
    compiles to a regex of the compiling process's id."""

    name = "spinning"

    def compile(self, constraint: Constraint):
        if constraint.value == SPIN:
            while True:
                pass
        if constraint.value == HOG:
            hoard = bytearray(8 << 30)
            return hoard
        if constraint.value == PID:
            return super().compile(Constraint.regex(str(os.getpid())))
        return super().compile(constraint)


def _manager(timeout_s: float = 60.0, memory_mb: int = 2048, priority: str = "idle") -> GrammarManager:
    tokenizer = byte_tokenizer()
    registry = create_plugin_manager().registries.grammar_backends
    registry.register(SpinningBackend.name, SpinningBackend)
    context = GrammarContext(tokenizer, VOCAB_SIZE, (tokenizer.eos_token_id,))
    return GrammarManager(registry, context, SpinningBackend.name, timeout_s, worker_memory_mb=memory_mb,
                          worker_priority=priority)


def _run(manager: GrammarManager, request_id: str, constraint: Constraint, wait_s: float = 60.0):
    """Submit one request and collect it: ("ready", grammar) or ("failed", message)."""
    manager.submit(request_id, SamplingParams(max_tokens=8, constraint=constraint), request_id)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        ready, failed = manager.collect(0.2)
        if ready:
            return "ready", ready[0][1]
        if failed:
            return "failed", failed[0][1]
    raise AssertionError(f"{request_id} neither compiled nor failed in {wait_s} s")


def _text(grammar, tokenizer) -> str:
    """The one string a single-string grammar allows, read from its matcher greedily."""
    import torch

    from ember.plugin.grammar import is_allowed

    matcher, out = grammar.create_matcher(), []
    bitmask = torch.zeros((1, (VOCAB_SIZE + 31) // 32), dtype=torch.int32)
    while not matcher.is_finished:
        matcher.fill_bitmask(bitmask, 0)
        token = next(t for t in range(VOCAB_SIZE) if is_allowed(bitmask[0], t) and t != tokenizer.eos_token_id)
        assert matcher.accept_tokens([token]) == 1
        out.append(token)
    return tokenizer.decode(out)


def test_compiles_run_in_a_worker_and_come_back_cached():
    manager = _manager()
    try:
        status, grammar = _run(manager, "a", Constraint.regex(PID))
        assert status == "ready"
        (worker,) = manager.pool.worker_pids()
        assert worker != os.getpid() and _text(grammar, byte_tokenizer()) == str(worker)
        assert manager.num_compiles == 1 and manager.num_cache_hits == 0
        status, again = _run(manager, "b", Constraint.regex(PID))
        assert status == "ready" and again is grammar and manager.num_cache_hits == 1 and manager.num_compiles == 1
        # the worker runs under SCHED_IDLE: only CPU that serving leaves idle
        assert os.sched_getscheduler(worker) == os.SCHED_IDLE
    finally:
        manager.close()


def test_a_niceness_instead_of_sched_idle():
    manager = _manager(priority="10")
    try:
        assert _run(manager, "a", Constraint.regex("[ab]+"))[0] == "ready"
        (worker,) = manager.pool.worker_pids()
        assert os.sched_getscheduler(worker) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, worker) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    finally:
        manager.close()


@pytest.mark.parametrize("value", ["20", "-1", "nice", "", True, 2.5])
def test_the_compile_priority_refuses_bad_values_naming_itself(value):
    from ember.api.settings import ServerSettings
    from ember.config import EngineConfig

    with pytest.raises(ValueError, match=r"--grammar-compile-priority must be 'idle' \(SCHED_IDLE\) or a niceness"):
        ServerSettings(grammar_compile_priority=value)
    with pytest.raises(ValueError, match=r"grammar_compile_priority must be 'idle'"):
        EngineConfig(model="m", grammar_compile_priority=value)


def test_a_compile_past_the_timeout_is_killed_and_its_worker_replaced():
    manager = _manager(timeout_s=1.0)
    try:
        assert _run(manager, "warm", Constraint.regex("[ab]+"))[0] == "ready"  # the worker started
        (spinner,) = manager.pool.worker_pids()
        started = time.monotonic()
        status, message = _run(manager, "spin", Constraint.regex(SPIN))
        assert status == "failed" and time.monotonic() - started < 8  # 1 CPU second, or 4 s in all
        assert "took longer than 1 s" in message and "--grammar-compile-timeout" in message
        with pytest.raises(ProcessLookupError):  # killed, not left spinning
            for _ in range(50):
                os.kill(spinner, 0)
                time.sleep(0.1)
        assert manager.num_compile_timeouts == 1 and manager.pool.num_killed == 1
        status, grammar = _run(manager, "next", Constraint.regex(PID))
        (replacement,) = manager.pool.worker_pids()
        assert status == "ready" and replacement != spinner and _text(grammar, byte_tokenizer()) == str(replacement)
        # a timeout is not cached: the same constraint compiles (and is stopped) again
        assert _run(manager, "spin again", Constraint.regex(SPIN))[0] == "failed"
        assert manager.num_compile_timeouts == 2
    finally:
        manager.close()


def test_a_compile_over_its_memory_limit_is_stopped():
    manager = _manager(memory_mb=512)
    try:
        status, message = _run(manager, "hog", Constraint.regex(HOG))
        assert status == "failed"
        assert "512 MiB" in message and "--grammar-compile-memory" in message
        assert _run(manager, "after", Constraint.regex("[ab]+"))[0] == "ready"  # a fresh worker serves on
    finally:
        manager.close()


def test_a_queued_compile_nobody_waits_for_is_dropped():
    manager = _manager(timeout_s=2.0)
    try:
        assert _run(manager, "warm", Constraint.regex("[ab]+"))[0] == "ready"
        for request_id, pattern in (("spin", SPIN), ("dropped", "[cd]+"), ("later", "[ef]+")):
            manager.submit(request_id, SamplingParams(max_tokens=8, constraint=Constraint.regex(pattern)), request_id)
        assert manager.discard("dropped") == "dropped"
        outcomes: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while len(outcomes) < 2 and time.monotonic() < deadline:
            ready, failed = manager.collect(0.2)
            outcomes.update({item: "ready" for item, _ in ready} | {item: "failed" for item, _ in failed})
        assert outcomes == {"spin": "failed", "later": "ready"}
        assert manager.num_compiles == 2  # the warm-up and "[ef]+": "[cd]+" never compiled
    finally:
        manager.close()


def test_built_in_backends_serialize_their_grammars():
    from ember.plugins.grammar.xgrammar_backend import XGrammarBackend

    for cls in (OutlinesBackend, XGrammarBackend):
        assert cls.serializes_grammars
        check_grammar_backend(cls)


# -- size limits ------------------------------------------------------------------------------


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(("schema", "limit"), [
    ({"type": "object", "properties": {"x": {"enum": list(range(1025))}}}, "enum_values"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(257)}}, "properties"),
    ({"type": "string", "pattern": "a" * 2049}, "pattern_length"),
    (_nested(40), "depth"),
    ({"type": "string", "description": "x" * 300_000}, "schema_bytes"),
])
def test_each_limit_refuses_naming_itself_and_its_flag(schema, limit):
    with pytest.raises(ValueError, match=f"--grammar-limits {limit}=N") as refused:
        check_constraint(Constraint.json_schema(schema), GrammarLimits())
    assert "EMBER_GRAMMAR_LIMITS" in str(refused.value)
    check_constraint(Constraint.json_schema(schema), GrammarLimits(**{limit: 10**6}))  # raised: passes


def test_limits_parse_and_refuse_bad_values():
    assert GrammarLimits.parse("enum_values=5000, depth=64") == GrammarLimits(enum_values=5000, depth=64)
    for bad in ("enum=5", "depth=0", "depth=x", "depth"):
        with pytest.raises(ValueError, match="--grammar-limits"):
            GrammarLimits.parse(bad)
    with pytest.raises(ValueError, match="enum_values"):
        check_constraint(Constraint.choice([str(i) for i in range(11)]), GrammarLimits(enum_values=10))
    with pytest.raises(ValueError, match="pattern_length"):
        check_constraint(Constraint.regex("a" * 11), GrammarLimits(pattern_length=10))


def test_the_server_refuses_over_the_limits_and_kills_a_slow_compile(tiny_llama_dir: Path):
    """Through HTTP: a 400 naming the limit's flag; with the limit raised, a 30,000-value enum
    stopped at the 1 s timeout (a 400 naming --grammar-compile-timeout), then a small
    schema served by the replacement worker."""
    big = {"type": "object", "properties": {"x": {"enum": [f"value-{i}-abc" for i in range(30_000)]}},
           "required": ["x"]}
    wide = {"type": "object", "properties": {"x": {"enum": [f"v{i}" for i in range(2000)]}}, "required": ["x"]}
    small = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    def chat(client, schema):
        return client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        })

    with running_server(tiny_llama_dir) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        refused = chat(client, wide)
        assert refused.status_code == 400, refused.text
        assert "--grammar-limits enum_values=N" in refused.json()["error"]["message"]
    limits = {"grammar_limits": "enum_values=100000,schema_bytes=10000000", "grammar_compile_timeout_s": 1.0}
    with running_server(tiny_llama_dir, engine=limits) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        assert chat(c, small).status_code == 200  # the worker started
        started = time.monotonic()
        slow = chat(c, big)
        assert slow.status_code == 400 and time.monotonic() - started < 10, slow.text
        assert "--grammar-compile-timeout" in slow.json()["error"]["message"]
        served = chat(c, {**small, "properties": {"m": {"type": "integer"}}, "required": ["m"]})
        assert served.status_code == 200, served.text
        assert json.loads(served.json()["choices"][0]["message"]["content"]).keys() == {"m"}


def test_zero_workers_compile_on_threads_as_before():
    tokenizer = byte_tokenizer()
    registry = create_plugin_manager().registries.grammar_backends
    registry.register(SpinningBackend.name, SpinningBackend)
    context = GrammarContext(tokenizer, VOCAB_SIZE, (tokenizer.eos_token_id,))
    manager = GrammarManager(registry, context, SpinningBackend.name, 60.0, num_workers=0)
    status, grammar = _run(manager, "a", Constraint.regex(PID))
    assert status == "ready" and manager.pool is None and _text(grammar, tokenizer) == str(os.getpid())
