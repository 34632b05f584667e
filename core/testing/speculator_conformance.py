"""Conformance check for speculators: does a :class:`BaseSpeculator` keep the contract
in :mod:`ember.plugin.speculator`? Ember runs it against its own (``ngram``,
``draft_model``, ``medusa``, ``eagle``); a third party runs it against theirs::

    from ember.testing import check_speculator

    def test_my_speculator_conforms(tmp_path):
        check_speculator(MySpeculator, tmp_path)
        # one that reads a checkpoint: its target and the speculative-config keys
        check_speculator(MyHeads, tmp_path, model_dir=target_dir, config={"model": str(heads_dir)})

The speculator runs inside a real engine on a tiny random Llama (built in
``work_dir``; or ``model_dir``), float32 on the CPU backend, with prefix caching,
chunked prefill and a KV cache small enough to force preemption. Raises
AssertionError naming the first broken rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ember.plugin.speculator import BaseSpeculator, Proposal, SpecRequest

# prompts with repeats in them, so that a prompt-lookup speculator finds matches
PROMPTS = [
    [(i % 7) + 10 for i in range(40)],
    [20, 21, 22, 23, 24, 25] * 5 + [20, 21],
    list(range(60, 90)) + list(range(60, 75)),
    [5, 6, 7] * 3,
]
_NAME = "under-check"


class _ContractRecorder:
    """Wraps a speculator's ``propose`` and records the first broken rule."""

    def __init__(self, speculator: BaseSpeculator, vocab_size: int) -> None:
        self.speculator = speculator
        self.vocab_size = vocab_size
        self.inner = speculator.propose
        self.broken: str | None = None
        self.num_calls = 0
        self.num_drafts = 0
        speculator.propose = self.propose  # type: ignore[method-assign]

    def _fail(self, message: str) -> None:
        if self.broken is None:
            self.broken = message

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        self.num_calls += 1
        before = [(list(r.prompt_token_ids), list(r.output_token_ids)) for r in requests]
        proposals = self.inner(requests)
        name = type(self.speculator).__name__
        if not isinstance(proposals, list) or len(proposals) != len(requests):
            self._fail(f"{name}.propose returned {proposals!r} for {len(requests)} requests: one Proposal per "
                       "request, in order")
            return proposals
        for request, (prompt, output), proposal in zip(requests, before, proposals):
            where = f"{name}.propose, request {request.request_id!r}"
            if request.prompt_token_ids != prompt or request.output_token_ids != output:
                self._fail(f"{where}: changed the request's token lists (they are the engine's: read only)")
            if not isinstance(proposal, Proposal):
                self._fail(f"{where}: returned {type(proposal).__name__}, not a Proposal")
                continue
            ids = proposal.token_ids
            if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                self._fail(f"{where}: token_ids must be a list of int, got {ids!r}")
                continue
            if len(ids) > request.max_drafts:
                self._fail(f"{where}: {len(ids)} drafts offered {request.max_drafts} (max_drafts)")
            if any(not 0 <= t < self.vocab_size for t in ids):
                self._fail(f"{where}: a token outside [0, {self.vocab_size}): {ids}")
                continue
            self.num_drafts += len(ids)
            probs = proposal.probs
            if probs is None or not ids:
                continue
            if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.shape[0] < len(ids) \
                    or probs.shape[1] < self.vocab_size:
                self._fail(f"{where}: probs must be a (num_drafts, vocab_size) tensor, got "
                           f"{getattr(probs, 'shape', probs)!r} for {len(ids)} drafts over {self.vocab_size}")
                continue
            q = probs[: len(ids), : self.vocab_size].double()
            if not torch.isfinite(q).all() or (q < 0).any():
                self._fail(f"{where}: probs hold negative or non-finite values")
            elif not torch.allclose(q.sum(-1), torch.ones(len(ids), dtype=q.dtype), atol=1e-3):
                self._fail(f"{where}: a row of probs sums to {q.sum(-1).tolist()}, not 1")
            elif (q[torch.arange(len(ids)), torch.tensor(ids)] <= 0).any():
                self._fail(f"{where}: a draft has probability 0 under the q it was drawn from ({ids})")
        return proposals


def _generate(engine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(None, p, prompt_token_ids=prompt) for prompt, p in zip(prompts, params)]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def check_speculator(
    cls: type[BaseSpeculator],
    work_dir,
    *,
    model_dir=None,
    config: Mapping[str, Any] | None = None,
    prompts: list[list[int]] | None = None,
    num_tokens: int = 32,
    expect_drafts: bool = True,
) -> None:
    """Check ``cls`` against the speculator contract:

    - the class: a :class:`BaseSpeculator` with a non-empty ``name`` and bool
      ``uses_hidden_states`` / ``uses_all_hidden_states``;
    - every ``propose`` call returns one :class:`Proposal` per request, in order, at most
      ``max_drafts`` int tokens in ``[0, vocab_size)`` each, leaves the engine's token
      lists alone, and gives sampled drafts a ``q`` that is a distribution with
      ``q(draft) > 0``;
    - greedy outputs with it equal those without speculation, token for token, with
      prefix caching, chunked prefill and preemption, and every KV block is free again
      at the end (rejected positions hold nothing);
    - it proposed something (``expect_drafts``: the prompts repeat themselves, so a
      prompt-lookup speculator must find drafts; pass False for one that may not);
    - seeded sampled requests (temperature 0.8) give the same tokens on a second
      engine built alike and sent the same requests.

    ``config``: more speculative-config keys (``model`` for a speculator that reads a
    checkpoint); ``num_speculative_tokens`` defaults to 4, and speculation stays on at
    every batch size and acceptance rate.
    """
    from ember import EngineConfig, SamplingParams
    from ember.engine.llm_engine import LLMEngine
    from ember.plugin import create_plugin_manager, hookimpl
    from ember.testing.tiny_models import make_tiny_model

    assert isinstance(cls, type) and issubclass(cls, BaseSpeculator), f"{cls!r} is not a BaseSpeculator"
    assert isinstance(getattr(cls, "name", None), str) and cls.name, f"{cls.__name__}.name must be a non-empty str"
    for attr in ("uses_hidden_states", "uses_all_hidden_states"):
        assert isinstance(getattr(cls, attr), bool), f"{cls.__name__}.{attr} must be a bool"

    class _Plugin:
        @hookimpl
        def ember_register_speculators(self, registry) -> None:
            registry.register(_NAME, cls)

    if model_dir is None:
        model_dir = Path(work_dir) / "tiny-llama-target"
        if not (model_dir / "config.json").exists():
            make_tiny_model("llama", model_dir, seed=3)
    prompts = prompts or PROMPTS
    spec = {"num_speculative_tokens": 4, "disable_by_batch_size": None, "min_acceptance_rate": 0.0,
            **(config or {}), "method": _NAME}
    # blocks of 4, 40 of them (160 tokens for requests of up to ~77): preemption; a
    # 16-token step budget: chunked prefill; the last prompt shares a prefix with the first
    # the CPU backend's batch-invariant mode: a verification step computes a token's
    # numbers exactly as a plain decode does, so that greedy tokens can be compared
    engine_args = dict(model=str(model_dir), dtype="float32", backend="cpu", block_size=4, num_kv_blocks=40,
                       max_num_batched_tokens=16, enable_prefix_caching=True, max_model_len=256,
                       backend_options={"batch_invariant": "1"})
    greedy = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    all_prompts = list(prompts) + [list(prompts[0][: max(1, len(prompts[0]) // 2)])]
    plain = LLMEngine(EngineConfig(**engine_args), create_plugin_manager())
    expected = _generate(plain, all_prompts, [greedy] * len(all_prompts))
    del plain
    engine = LLMEngine(EngineConfig(**engine_args, speculative_config=spec),
                       create_plugin_manager(extra_plugins=((_NAME, _Plugin()),)))
    decoder = engine.core.speculator
    assert decoder is not None and isinstance(decoder.speculator, cls), (
        f"the engine did not build {cls.__name__} for method {_NAME!r}"
    )
    recorder = _ContractRecorder(decoder.speculator, engine.model_info.vocab_size)
    got = _generate(engine, all_prompts, [greedy] * len(all_prompts))
    assert recorder.broken is None, recorder.broken
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a == b, (
            f"{cls.__name__}: greedy tokens of prompt {i} with speculation differ from those without: "
            f"{a} vs {b}"
        )
    stats = decoder.stats
    if expect_drafts:
        assert recorder.num_drafts > 0 and stats.num_draft_tokens > 0, (
            f"{cls.__name__} proposed no draft in {recorder.num_calls} calls on prompts that repeat themselves "
            "(pass expect_drafts=False if it may not)"
        )
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks, (
        f"{kv.num_blocks - kv.num_free_blocks} KV blocks still held after every request finished"
    )
    sampled = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=num_tokens // 2, ignore_eos=True)
               for i in range(len(prompts))]
    first = _generate(engine, list(prompts), sampled)
    assert recorder.broken is None, recorder.broken
    del engine, decoder
    # the same requests in the same order on a second engine built alike: the same tokens
    again = LLMEngine(EngineConfig(**engine_args, speculative_config=spec),
                      create_plugin_manager(extra_plugins=((_NAME, _Plugin()),)))
    _generate(again, all_prompts, [greedy] * len(all_prompts))
    second = _generate(again, list(prompts), sampled)
    assert first == second, (
        f"{cls.__name__}: seeded sampled requests gave different tokens on a second engine built alike"
    )
