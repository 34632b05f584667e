"""The step contract (ember.sched.step): values, not objects, between the scheduler and the
runner; and its two slots, driven by a fake speculator and a fake grammar mask."""

import io
import pickle

import pytest
import torch
from tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.config import SpeculativeConfig
from ember.engine.speculative import SpeculativeDecoder
from ember.plugin.speculator import BaseSpeculator, Proposal, SpeculatorContext
from ember.sched.step import ModelRunnerOutput, SchedulerOutput

# What a step's values may reference when pickled: the contract's own dataclasses,
# sampling params, logprob entries, tensors and builtins. No Request, scheduler,
# KV manager, runner or model.
ALLOWED_MODULES = ("ember.sched.step", "ember.sampling_params", "ember.logprobs", "torch", "builtins", "collections", "copyreg")


class _Recorder(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.classes: set[tuple[str, str]] = set()

    def find_class(self, module, name):
        self.classes.add((module, name))
        return super().find_class(module, name)


def _roundtrip(value):
    recorder = _Recorder(pickle.dumps(value))
    copy = recorder.load()
    foreign = {(m, n) for m, n in recorder.classes if not m.startswith(ALLOWED_MODULES)}
    assert not foreign, f"engine objects in the step contract: {sorted(foreign)}"
    return copy


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-step")
    make_tiny_model("llama", path, seed=5, max_position_embeddings=256)
    return LLM(model=str(path), dtype="float32", num_kv_blocks=96, block_size=4, enable_prefix_caching=True)


PROMPTS = [[5, 9, 17, 3, 88, 41, 7], [12, 12, 12, 60], list(range(30, 51))]


def _generate(llm, params, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def test_a_runner_fed_only_pickled_copies_gives_the_same_tokens(llm):
    """The runner gets unpickled copies of every scheduler output (as a runner in
    another process would) and the scheduler an unpickled copy of every runner
    output: the tokens do not change, so nothing else crosses between them."""
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12, logprobs=2, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, ignore_eos=True),
    ]
    expected = [o.outputs[0] for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    engine = llm.engine
    execute = engine.runner.execute
    seen = {"steps": 0, "new": 0, "cached": 0}

    def execute_copy(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        copy = _roundtrip(scheduler_output)
        assert copy.num_scheduled_tokens == scheduler_output.num_scheduled_tokens
        seen["steps"] += 1
        seen["new"] += len(copy.new_requests)
        seen["cached"] += len(copy.cached_requests)
        return _roundtrip(execute(copy))

    engine.runner.execute = execute_copy
    try:
        got = [o.outputs[0] for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    finally:
        del engine.runner.execute
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.logprobs for c in got] == [c.logprobs for c in expected]
    # each request is sent in full once; afterwards only deltas
    assert seen["new"] == len(PROMPTS) and seen["cached"] >= seen["steps"] - 1


class OracleSpeculator(BaseSpeculator):
    """Proposes the true greedy continuation (known from a run without speculation),
    with every ``wrong_every``-th proposal corrupted."""

    name = "oracle"

    def __init__(self, continuations: dict[tuple, list[int]], k: int, wrong_every: int = 0) -> None:
        super().__init__(SpeculatorContext(SpeculativeConfig("oracle", k), 1 << 20, ()))
        self.continuations, self.k, self.wrong_every = continuations, k, wrong_every
        self.calls = 0

    def propose(self, requests):
        proposals = []
        for r in requests:
            self.calls += 1
            truth = self.continuations[tuple(r.prompt_token_ids)]
            n = len(r.output_token_ids)
            draft = list(truth[n : n + self.k])
            if self.wrong_every and self.calls % self.wrong_every == 0 and draft:
                draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 256
            proposals.append(Proposal(draft))
        return proposals

    def decoder(self) -> SpeculativeDecoder:
        """Offered to every request every step (no batch-size, acceptance or cost limits)."""
        return SpeculativeDecoder(self, SpeculativeConfig(
            "oracle", self.k, disable_by_batch_size=None, min_acceptance_rate=0.0, cost_aware=False))


@pytest.mark.parametrize("wrong_every", [0, 2, 1])
def test_draft_tokens_slot_gives_the_same_greedy_tokens_in_fewer_steps(llm, wrong_every):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = _generate(llm, params)
    engine = llm.engine
    steps_without = _count_steps(llm, params)
    engine.core.speculator = OracleSpeculator(
        {tuple(p): r for p, r in zip(PROMPTS, reference)}, k=3, wrong_every=wrong_every
    ).decoder()
    try:
        steps_with = _count_steps(llm, params)
        got = _generate(llm, params)
    finally:
        engine.core.speculator = None
    assert got == reference
    if wrong_every != 1:
        assert steps_with < steps_without, (steps_with, steps_without)
    # rejected drafts left nothing behind: the pool is whole, and a fresh run over
    # the same prompts (prefix-cache hits on blocks computed with drafts) agrees
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert _generate(llm, params) == reference


def test_drafts_under_seeded_sampling_are_reproducible(llm):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    engine = llm.engine
    engine.core.speculator = OracleSpeculator({tuple(p): [1] * 40 for p in PROMPTS}, k=2).decoder()
    try:
        first = _generate(llm, params)
        second = _generate(llm, params)
    finally:
        engine.core.speculator = None
    assert first == second and all(len(t) == 10 for t in first)


def _count_steps(llm, params):
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(None, params, prompt_token_ids=prompt, request_id=f"count-{i}")
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps


class OnlyTokens:
    """A fake grammar: at every position only ``allowed`` tokens may follow."""

    def __init__(self, vocab_size: int, allowed: list[int]) -> None:
        self.mask = torch.zeros(vocab_size, dtype=torch.bool)
        self.mask[allowed] = True
        self.calls = 0

    def allowed_tokens(self, request_id, prompt_token_ids, output_token_ids, num_positions):
        self.calls += 1
        return self.mask.expand(num_positions, -1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_mask_slot_confines_every_sampled_token(llm, temperature):
    engine = llm.engine
    allowed = [3, 17, 42, 99]
    engine.core.token_masker = OnlyTokens(engine.hf_config.vocab_size, allowed)
    try:
        params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=1, logprobs=1)
        outs = [o.outputs[0] for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    finally:
        engine.core.token_masker = None
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    for out in outs:
        assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed), out.token_ids
        # the logprob is under the masked distribution: the four tokens share all the mass
        assert all(lp <= 0.0 and lp > -30 for lp in out.token_logprobs)


def test_allowed_token_mask_of_the_wrong_shape_is_refused(llm):
    engine = llm.engine

    class Bad:
        def allowed_tokens(self, *args):
            return torch.ones(3, dtype=torch.bool)

    engine.core.token_masker = Bad()
    try:
        with pytest.raises(ValueError, match="allowed-token mask"):
            llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=SamplingParams(max_tokens=2))
    finally:
        engine.core.token_masker = None
        engine.abort_all()


@pytest.mark.parametrize("stop", [(), ("e",), ("zz", "a b")])
def test_delta_outputs_concatenate_to_the_cumulative_ones(llm, stop):
    """DELTA outputs carry only what is new; joined, they are the CUMULATIVE output."""
    from ember.engine.output_processor import OutputKind

    engine = llm.engine
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=20, stop=stop, logprobs=1)
    finals = {}
    deltas = {"text": "", "ids": [], "lps": [], "logprobs": []}
    engine.add_request(None, params, prompt_token_ids=PROMPTS[0], request_id="cum")
    engine.add_request(None, params, prompt_token_ids=PROMPTS[0], request_id="delta", output_kind=OutputKind.DELTA)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "delta":
                c = out.outputs[0]
                assert c.text == out.new_text and c.token_ids == out.new_token_ids
                deltas["text"] += c.text
                deltas["ids"] += c.token_ids
                deltas["lps"] += c.token_logprobs
                deltas["logprobs"] += c.logprobs
                if out.finished:
                    finals["delta"] = c
            elif out.finished:
                finals["cum"] = out.outputs[0]
    cum = finals["cum"]
    assert deltas["text"] == cum.text and deltas["ids"] == cum.token_ids
    assert deltas["lps"] == cum.token_logprobs and deltas["logprobs"] == cum.logprobs
    assert finals["delta"].finish_reason == cum.finish_reason and finals["delta"].stop_reason == cum.stop_reason
