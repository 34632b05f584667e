"""The scheduler and KV manager driven by hand-built runner outputs: no model."""

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.config import SchedulerConfig
from ember.sampling_params import SamplingParams
from ember.sched.kv_cache_manager import KVCacheManager
from ember.sched.request import Request, RequestStatus
from ember.sched.scheduler import ModelRunnerOutput, Scheduler
from ember.sched.step import SchedulerOutput

EOS = 2


@dataclass(frozen=True)
class Item:
    """One request's share of a step, as the runner reconstructs it from the deltas."""

    request_id: str
    num_tokens: int
    start_position: int
    block_table: list[int]
    needs_sample: bool
    token_ids: list[int]
    is_prefill: bool


def view(sched: Scheduler, out: SchedulerOutput) -> list[Item]:
    """Apply a step's value to a runner-side mirror (block tables from NewRequest and
    CachedRequest deltas only) and check it against the scheduler's own tables.
    Call once per step, right after schedule()."""
    mirror = sched.__dict__.setdefault("test_mirror", {})
    seen = sched.__dict__.setdefault("test_seen", set())
    if id(out) in seen:
        raise AssertionError("view() applies a step once")
    for rid in out.finished_request_ids | out.preempted_request_ids:
        mirror.pop(rid, None)
    for new in out.new_requests:
        assert new.request_id not in mirror, f"{new.request_id} sent in full twice"
        mirror[new.request_id] = (list(new.block_ids), new.num_computed_tokens)
    for cached in out.cached_requests:
        table, _ = mirror[cached.request_id]
        mirror[cached.request_id] = (table + list(cached.new_block_ids), cached.num_computed_tokens)
    items = []
    for rid, n in out.num_scheduled_tokens.items():
        table, start = mirror[rid]
        request = sched.requests[rid]
        assert table == sched.kv.get_block_table(rid), (rid, table, sched.kv.get_block_table(rid))
        assert start == request.num_computed_tokens
        items.append(Item(
            rid, n, start, table, rid in out.sampling_request_ids, request.all_token_ids[start : start + n],
            start < request.num_prompt_tokens or n > 1,
        ))
    return Step(items, out)


class Step(list):
    """The items of a step, with the step's value as `.step`."""

    def __init__(self, items, step):
        super().__init__(items)
        self.step = step


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, max_batched=64, max_model_len=64, prefix_caching=False,
                   chunked_prefill=False, context_scale=None, prefill_batched=None):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(max_num_seqs, max_batched, max_model_len, chunked_prefill, context_scale, prefill_batched)
    return Scheduler(config, kv)


def make_request(rid, prompt_len, max_tokens=4, **params):
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(10, 10 + prompt_len)),
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, **params),
        eos_token_ids=(EOS,),
    )


def run_step(sched, token=7):
    out = sched.schedule()
    items = view(sched, out)
    sampled = [[token] if s.needs_sample else [] for s in items]
    updates = sched.update_from_output(out, ModelRunnerOutput([s.request_id for s in items], sampled))
    return items, updates


def test_prefill_then_decode_one_token_per_step():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    out, _ = run_step(sched)
    [item] = out
    assert (item.request_id, item.num_tokens, item.start_position, item.is_prefill) == ("a", 5, 0, True)
    assert item.token_ids == [10, 11, 12, 13, 14]
    assert item.block_table == [0, 1]
    assert sum(s.num_tokens for s in out) == 5
    out, _ = run_step(sched)
    [item] = out
    assert (item.num_tokens, item.start_position, item.is_prefill) == (1, 5, False)
    assert item.token_ids == [7]
    assert item.block_table == [0, 1]


def test_new_request_joins_running_batch_and_finished_one_leaves():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3, max_tokens=2))
    run_step(sched)
    sched.add_request(make_request("b", 6, max_tokens=3))
    out, updates = run_step(sched)
    assert [(s.request_id, s.num_tokens) for s in out] == [("a", 1), ("b", 6)]
    assert sum(s.num_tokens for s in out) == 7
    a = updates[0].request
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [7, 7]
    assert sched.kv.get_block_table("a") == []
    assert (len(sched.running), len(sched.waiting)) == (1, 0)
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_tokens) for s in out] == [("b", 1)]
    assert out.step.finished_request_ids == frozenset({"a"})


def test_eos_and_stop_tokens_respect_min_tokens_and_ignore_eos():
    sched = make_scheduler()
    sched.add_request(make_request("eos", 2, max_tokens=5))
    sched.add_request(make_request("min", 2, max_tokens=5, min_tokens=2))
    sched.add_request(make_request("ign", 2, max_tokens=3, ignore_eos=True))
    sched.add_request(make_request("stop", 2, max_tokens=5, stop_token_ids=[9], ignore_eos=True))
    _, updates = run_step(sched, token=EOS)
    status = {u.request.request_id: u.request.status for u in updates}
    assert status["eos"] == RequestStatus.FINISHED_STOPPED
    assert status["min"] == RequestStatus.RUNNING
    assert status["ign"] == RequestStatus.RUNNING
    assert status["stop"] == RequestStatus.RUNNING
    _, updates = run_step(sched, token=9)
    status = {u.request.request_id: u.request.status for u in updates}
    assert status == {
        "min": RequestStatus.RUNNING,
        "ign": RequestStatus.RUNNING,
        "stop": RequestStatus.FINISHED_STOPPED,
    }
    assert updates[-1].request.stop_token_id == 9
    _, updates = run_step(sched, token=EOS)
    status = {u.request.request_id: u.request.status for u in updates}
    assert status == {"min": RequestStatus.FINISHED_STOPPED, "ign": RequestStatus.FINISHED_LENGTH}
    assert sched.kv.num_free_blocks == 16


def test_token_budget_and_running_cap_keep_fcfs_order():
    sched = make_scheduler(max_batched=10, max_num_seqs=2, max_model_len=10)
    for rid, n in [("a", 6), ("b", 5), ("c", 1)]:
        sched.add_request(make_request(rid, n))
    out, _ = run_step(sched)
    # b does not fit the remaining budget of 4; c must wait behind it (FCFS).
    assert [s.request_id for s in out] == ["a"]
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_tokens) for s in out] == [("a", 1), ("b", 5)]
    out, _ = run_step(sched)
    # two running: the cap keeps c waiting
    assert [s.request_id for s in out] == ["a", "b"]
    assert (len(sched.running), len(sched.waiting)) == (2, 1)


def test_request_waits_for_kv_blocks_until_another_finishes():
    # 4 blocks of 4 tokens; each request may need prompt 5 + max_tokens 3 = 8 tokens = 2 blocks.
    sched = make_scheduler(num_blocks=4, block_size=4)
    for rid in "abc":
        sched.add_request(make_request(rid, 5, max_tokens=3))
    out, _ = run_step(sched)
    assert [s.request_id for s in out] == ["a", "b"]
    assert sched.kv.get_block_table("a") == [0, 1] and sched.kv.get_block_table("b") == [2, 3]
    assert (len(sched.running), len(sched.waiting)) == (2, 1)
    run_step(sched)
    out, _ = run_step(sched)  # a and b reach max_tokens=3 here and free their blocks
    assert len(sched.running) == 0 and sched.kv.num_free_blocks == 4
    out, _ = run_step(sched)
    # freed tail first: a gave back [1, 0], b [3, 2]; c takes the least recently freed
    assert [(s.request_id, s.block_table) for s in out] == [("c", [1, 0])]


def test_abort_frees_blocks_at_once():
    sched = make_scheduler()
    sched.add_request(make_request("a", 9))
    sched.add_request(make_request("w", 3))
    run_step(sched)
    assert sched.kv.num_free_blocks < 16
    assert sched.abort_request("a") and sched.abort_request("w")
    assert not sched.abort_request("a")
    assert sched.kv.num_free_blocks == 16
    assert not sched.has_unfinished_requests()


def test_requests_that_can_never_run_are_refused():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="prompt has 64 tokens"):
        sched.add_request(make_request("long", 64))
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        sched.add_request(make_request("big", 10, max_tokens=10))
    sched.add_request(make_request("ok", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 3))


def test_context_limit_finishes_with_length():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("a", 6, max_tokens=100))
    run_step(sched)
    _, updates = run_step(sched)
    assert updates[0].request.status == RequestStatus.FINISHED_LENGTH
    assert updates[0].request.num_tokens == 8


def test_prefix_cache_hit_skips_computed_blocks_and_shares_them():
    sched = make_scheduler(prefix_caching=True)
    sched.add_request(make_request("a", 10, max_tokens=5))
    out, _ = run_step(sched)
    assert out[0].num_tokens == 10
    a_table = sched.kv.get_block_table("a")
    sched.add_request(make_request("b", 10, max_tokens=2))  # same prompt
    out, _ = run_step(sched)
    b = [s for s in out if s.request_id == "b"][0]
    # 2 full blocks (8 tokens) cached; the last 2 prompt tokens are computed
    assert (b.num_tokens, b.start_position, b.is_prefill) == (2, 8, True)
    assert b.token_ids == [18, 19]
    assert b.block_table[:2] == a_table[:2] and b.block_table[2] not in a_table
    assert sched.kv.pool.blocks[a_table[0]].ref_count == 2
    assert sched.kv.prefix_hit_rate == 8 / 20
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.kv.num_free_blocks == 16
    # after both finished, the prefix is still cached for the next request
    assert sched.kv.find_cached_prefix(list(range(10, 20))) == a_table[:2]


def test_chunked_prefill_splits_a_long_prompt_and_decodes_go_first():
    sched = make_scheduler(num_blocks=32, block_size=4, max_batched=8, max_model_len=64, chunked_prefill=True)
    sched.add_request(make_request("short", 3, max_tokens=10))
    run_step(sched)  # short: prefilled, first token sampled
    sched.add_request(make_request("long", 20, max_tokens=2))
    steps = []
    while sched.requests.get("long") is not None and not sched.requests["long"].output_token_ids:
        out, _ = run_step(sched)
        steps.append([(s.request_id, s.num_tokens, s.start_position, s.needs_sample) for s in out])
    # every step: the decode first (1 token), then up to 7 prompt tokens of "long"
    assert steps == [
        [("short", 1, 3, True), ("long", 7, 0, False)],
        [("short", 1, 4, True), ("long", 7, 7, False)],
        [("short", 1, 5, True), ("long", 6, 14, True)],
    ]
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.kv.num_free_blocks == 32


def test_long_prompt_chunks_shrink_with_their_context_while_others_decode():
    """With prefill_context_scale, a chunk's token at position p takes 1 + p / scale of
    the step's budget while requests decode beside it; alone, a prompt takes the whole
    budget per step as before."""
    scale, budget = 64.0, 33

    def chunks(with_stream: bool) -> list[tuple[int, int]]:
        sched = make_scheduler(num_blocks=128, block_size=4, max_batched=budget, max_model_len=512,
                               chunked_prefill=True, context_scale=scale)
        if with_stream:
            sched.add_request(make_request("stream", 3, max_tokens=200))
            run_step(sched)
        sched.add_request(make_request("long", 300, max_tokens=1))
        seen = []
        while "long" in sched.requests and not sched.requests["long"].output_token_ids:
            items, _ = run_step(sched)
            for s in items:
                if s.request_id == "long":
                    seen.append((s.start_position, s.num_tokens))
                else:  # the stream decodes at every step
                    assert s.num_tokens == 1
        return seen

    alone = chunks(False)
    assert [n for _, n in alone[:-1]] == [budget] * (len(alone) - 1)
    beside = chunks(True)
    assert sum(n for _, n in beside) == 300 and beside[0][0] == 0
    for (start, n), (next_start, _) in zip(beside, beside[1:]):
        assert next_start == start + n
    for start, n in beside[:-1]:  # each chunk as large as the weighted budget allows
        cost = lambda c: c * (1 + (start + c / 2) / scale)  # noqa: E731
        assert cost(n) <= budget - 1 < cost(n + 1), (start, n)
    sizes = [n for _, n in beside]
    assert sizes[0] > sizes[len(sizes) // 2] > sizes[-2]  # later chunks (longer context) are smaller
    assert len(beside) > len(alone)


def test_prompts_alone_take_the_prefill_budget_and_streams_bring_back_the_step_budget():
    sched = make_scheduler(num_blocks=64, block_size=4, max_batched=8, max_model_len=128, chunked_prefill=True,
                           prefill_batched=32)
    sched.add_request(make_request("a", 50, max_tokens=3))
    sched.add_request(make_request("b", 10, max_tokens=3))
    items, _ = run_step(sched)  # nobody decodes: 32 tokens of prompts
    assert [(s.request_id, s.num_tokens) for s in items] == [("a", 32)]
    items, _ = run_step(sched)
    assert [(s.request_id, s.num_tokens) for s in items] == [("a", 18), ("b", 10)]
    sched.add_request(make_request("c", 40, max_tokens=1))
    items, _ = run_step(sched)  # a and b decode now: the 8-token budget, c gets what is left
    assert [(s.request_id, s.num_tokens) for s in items] == [("a", 1), ("b", 1), ("c", 6)]
    with pytest.raises(ValueError, match=r"prefill_step_tokens \(4\) must be >= max_num_batched_tokens \(8\)"):
        SchedulerConfig(8, 8, 64, True, None, 4)


def test_the_engine_takes_the_backends_prefill_budget_unless_the_user_set_one(tiny_llama_dir):
    from ember import LLM

    llm = LLM(model=str(tiny_llama_dir))
    config = llm.engine.core.scheduler.config
    assert (config.max_num_batched_tokens, config.prefill_step_tokens) == (512, 4096)  # the CPU backend's
    user = LLM(model=str(tiny_llama_dir), max_num_batched_tokens=256)
    assert user.engine.core.scheduler.config.prefill_step_tokens is None  # the user's budget holds for every step


def test_prefill_context_scale_of_a_llama_config():
    from transformers import LlamaConfig

    from ember.models.loader import prefill_context_scale

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    # per layer: q, o 576 x 576; k, v 576 x 192; gate, up, down 576 x 1536
    assert prefill_context_scale(cfg) == (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) / (2 * 576)
    assert prefill_context_scale(object()) is None
    with pytest.raises(ValueError, match="prefill_context_scale"):
        SchedulerConfig(prefill_context_scale=0)


def test_step_budget_below_the_context_needs_chunked_prefill():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be >= max_model_len \(64\)"):
        SchedulerConfig(8, 16, 64, enable_chunked_prefill=False)
    sched = make_scheduler(max_batched=16, max_model_len=64, chunked_prefill=True)
    sched.add_request(make_request("x", 40))  # longer than a step: accepted, prefilled in 3 steps
    sizes = [run_step(sched)[0][0].num_tokens for _ in range(3)]
    assert sizes == [16, 16, 8]


def test_preemption_frees_the_most_recent_request_and_resumes_it_with_its_tokens():
    # 5 blocks of 4 tokens; prompts of 4 (1 block), up to 12 new tokens (worst case 4 blocks)
    sched = make_scheduler(num_blocks=5, block_size=4)
    for rid in "abc":
        sched.add_request(make_request(rid, 4, max_tokens=12, ignore_eos=True))
    out, _ = run_step(sched)
    assert [(s.request_id, s.block_table) for s in out] == [("a", [0]), ("b", [1]), ("c", [2])]
    # each decode needs a 2nd block: a and b get one, the pool is empty for c,
    # and c, the most recently admitted, is preempted (its own victim)
    out, _ = run_step(sched)
    assert [(s.request_id, s.block_table) for s in out] == [("a", [0, 3]), ("b", [1, 4])]
    c = sched.requests["c"]
    assert (c.status, c.num_computed_tokens, c.num_preemptions, c.output_token_ids) == (RequestStatus.WAITING, 0, 1, [7])
    assert [r.request_id for r in sched.waiting] == ["c"] and sched.num_preemptions == 1
    for _ in range(3):
        out, _ = run_step(sched)
        assert [s.request_id for s in out] == ["a", "b"]  # nobody is admitted into a full pool
    # 9th token: a takes c's freed block; b finds none and is preempted; b queues
    # ahead of c (it arrived first)
    out, _ = run_step(sched)
    assert [(s.request_id, s.block_table) for s in out] == [("a", [0, 3, 2])]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    b = sched.requests["b"]
    assert b.output_token_ids == [7] * 5 and b.num_computed_tokens == 0
    # a runs alone until its 12 tokens are out (its worst case, 4 blocks, fits the pool)
    while "a" in sched.requests:
        out, _ = run_step(sched)
        assert [s.request_id for s in out][:1] == ["a"]
    # b resumes: its prompt and the 5 tokens it generated are computed again in one
    # prefill that samples its 6th token; c follows in the same step
    out, _ = run_step(sched)
    b_item, c_item = out
    assert (b_item.request_id, b_item.start_position, b_item.num_tokens, b_item.needs_sample) == ("b", 0, 9, True)
    assert b_item.token_ids == [10, 11, 12, 13] + [7] * 5 and b_item.is_prefill
    assert (c_item.request_id, c_item.num_tokens) == ("c", 5)
    assert len(b.output_token_ids) == 6
    while sched.has_unfinished_requests():
        run_step(sched)
    assert b.output_token_ids == [7] * 12 and c.output_token_ids == [7] * 12
    assert sched.kv.num_free_blocks == 5


def test_a_victim_scheduled_earlier_in_the_step_is_unscheduled_and_its_tokens_given_back():
    # Y (low priority) decodes; X (high priority) prefills in chunks. When X's chunk
    # finds no block, Y is the victim although decodes were scheduled first this step.
    sched = make_scheduler(num_blocks=4, block_size=4, max_batched=6, max_model_len=64, chunked_prefill=True)
    y = make_request("y", 3, max_tokens=10, ignore_eos=True)
    y.priority = 5
    sched.add_request(y)
    run_step(sched)
    sched.add_request(make_request("x", 12, max_tokens=1, ignore_eos=True))
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_tokens, s.block_table) for s in out] == [("y", 1, [0]), ("x", 5, [1, 2])]
    out, _ = run_step(sched)
    assert [(s.request_id, s.start_position, s.num_tokens, s.block_table) for s in out] == [
        ("x", 5, 5, [1, 2, 3])
    ]
    assert sum(s.num_tokens for s in out) == 5  # y's decode token was given back
    assert (y.status, y.num_computed_tokens, y.output_token_ids) == (RequestStatus.WAITING, 0, [7, 7])
    # x finishes its prompt; y recomputes in chunks too: the 4 tokens the budget and
    # the one free block allow, then the last one, which samples its 3rd token
    out, _ = run_step(sched)
    assert [(s.request_id, s.start_position, s.token_ids, s.needs_sample) for s in out] == [
        ("x", 10, [20, 21], True), ("y", 0, [10, 11, 12, 7], False)
    ]
    out, _ = run_step(sched)
    assert [(s.request_id, s.start_position, s.token_ids, s.needs_sample) for s in out] == [
        ("y", 4, [7], True)
    ]
    assert y.output_token_ids == [7, 7, 7] and "x" not in sched.requests


def test_priorities_order_the_queue_and_a_higher_one_preempts_a_lower():
    sched = make_scheduler(max_num_seqs=2)
    for rid, priority in [("low", 5), ("mid", 1), ("low2", 5), ("top", 0)]:
        request = make_request(rid, 3, max_tokens=4, ignore_eos=True)
        request.priority = priority
        sched.add_request(request)
    assert [r.request_id for r in sched.waiting] == ["top", "mid", "low", "low2"]
    out, _ = run_step(sched)
    assert [s.request_id for s in out] == ["top", "mid"]
    # an urgent arrival while the running cap is full preempts the lowest-priority
    # running request ("mid"), not "top"; equal priorities never preempt each other
    urgent = make_request("urgent", 3, max_tokens=2, ignore_eos=True)
    urgent.priority = -1
    sched.add_request(urgent)
    out, _ = run_step(sched)
    assert [s.request_id for s in out] == ["top", "urgent"]
    assert [r.request_id for r in sched.waiting] == ["mid", "low", "low2"]
    assert sched.requests["mid"].num_preemptions == 1
    order = []
    while sched.has_unfinished_requests():
        _, updates = run_step(sched)
        order += [u.request.request_id for u in updates if u.request.is_finished]
    assert order == ["urgent", "top", "mid", "low", "low2"]
    with pytest.raises(ValueError, match="priority must be an integer"):
        bad = make_request("bad", 3)
        bad.priority = 1.5
        sched.add_request(bad)


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(
        st.tuples(
            st.integers(1, 20),  # prompt length
            st.integers(1, 12),  # max_tokens
            st.integers(0, 3),  # steps before the next arrival
            st.booleans(),  # sample EOS right away?
            st.integers(-1, 30),  # abort after this many steps (-1: never)
            st.integers(0, 2),  # priority
        ),
        min_size=1,
        max_size=25,
    ),
    num_blocks=st.integers(8, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    prefix_caching=st.booleans(),
    chunked=st.booleans(),
)
def test_random_arrivals_and_finishes_never_leak_a_block(events, num_blocks, block_size, prefix_caching, chunked):
    # every prompt is range(10, 10 + n): with prefix caching on, they share prefixes
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=6,
                           max_batched=7 if chunked else 48, max_model_len=40, prefix_caching=prefix_caching,
                           chunked_prefill=chunked)
    aborts: dict[int, list[str]] = {}
    finished = []
    step = 0

    def do_step():
        nonlocal step
        step_out = sched.schedule()
        out = view(sched, step_out)
        # invariant: a block's reference count is the number of tables holding it,
        # and a block is free exactly when no table holds it
        owned = [b for r in sched.running for b in sched.kv.get_block_table(r.request_id)]
        for block in sched.kv.pool.blocks:
            assert block.ref_count == owned.count(block.block_id)
        if not prefix_caching:
            assert len(owned) == len(set(owned))
        assert len(set(owned)) + sched.kv.num_free_blocks == num_blocks
        # a preempted request waits with no blocks and nothing computed
        assert all(not sched.kv.get_block_table(r.request_id) and r.num_computed_tokens == 0 for r in sched.waiting)
        assert not set(map(id, sched.waiting)) & set(map(id, sched.running))
        for s in out:
            assert len(s.block_table) * block_size >= s.start_position + s.num_tokens
        sampled = [
            [EOS if (s.request_id.endswith("e") and sched.requests[s.request_id].num_output_tokens == 0) else 5]
            if s.needs_sample else []
            for s in out
        ]
        for update in sched.update_from_output(step_out, ModelRunnerOutput([s.request_id for s in out], sampled)):
            if update.request.is_finished:
                finished.append(update.request)
        for rid in aborts.pop(step, []):
            sched.abort_request(rid)
        step += 1

    for i, (prompt_len, max_tokens, gap, eos, abort_after, priority) in enumerate(events):
        rid = f"r{i}{'e' if eos else ''}"
        request = make_request(rid, prompt_len, max_tokens=max_tokens)
        request.priority = priority
        try:
            sched.add_request(request)
        except ValueError:
            continue  # larger than the whole cache: refused up front
        if abort_after >= 0:
            aborts.setdefault(step + abort_after, []).append(rid)
        for _ in range(gap):
            do_step()
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        do_step()
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == num_blocks
    assert all(block.ref_count == 0 for block in sched.kv.pool.blocks)
    assert sched.requests == {}
    # every request that was not aborted produced what it asked for, preempted or not
    for request in finished:
        if request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_output_tokens == request.sampling_params.max_tokens or request.num_tokens == 40
