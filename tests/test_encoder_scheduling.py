"""The scheduler's side of images, driven by hand-built runner outputs (no model):
which images a step encodes, where a prompt chunk stops for them, the encoder cache's
references, eviction and hand-over on preemption, and the block digests that keep two
images apart in the prefix cache."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.config import SchedulerConfig
from ember.multimodal.inputs import MultiModalItem
from ember.sampling_params import SamplingParams
from ember.sched.encoder_cache import EncoderCacheManager
from ember.sched.kv_cache_manager import KVCacheManager
from ember.sched.request import Request
from ember.sched.scheduler import ModelRunnerOutput, Scheduler

IMAGE = 99  # placeholder token id


def item(name: str, offset: int, length: int) -> MultiModalItem:
    return MultiModalItem("image", name, offset, length, {"pixel_values": torch.zeros(1)})


def request(rid: str, text_before: int, images: list[tuple[str, int]], text_after: int = 2, max_tokens: int = 2):
    """A prompt of ``text_before`` text tokens, then each image's run, then ``text_after`` tokens."""
    ids, items = list(range(1, text_before + 1)), []
    for name, length in images:
        items.append(item(name, len(ids), length))
        ids += [IMAGE] * length
    ids += list(range(50, 50 + text_after))
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), mm_items=tuple(items))


def make(budget: int, capacity: int, num_blocks: int = 64, block_size: int = 4, prefix: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=256),
                     KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix),
                     EncoderCacheManager(capacity))


def finish_step(sched: Scheduler, out) -> None:
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if rid in out.sampling_request_ids else [] for rid in ids]
    sched.update_from_output(out, ModelRunnerOutput(ids, sampled))


def test_chunk_stops_before_an_image_the_step_cannot_encode():
    sched = make(budget=20, capacity=100)
    sched.add_request(request("a", 3, [("img1", 12), ("img2", 12)]))
    out = sched.schedule()
    # 3 text tokens + img1 (12 embeddings) fit; img2 would pass the 20-embedding budget: stop before it
    assert out.num_scheduled_tokens == {"a": 15}
    assert out.encoder_inputs == {"a": [0]}
    finish_step(sched, out)
    out = sched.schedule()
    assert out.encoder_inputs == {"a": [1]}
    assert out.num_scheduled_tokens == {"a": 14}  # img2 and the 2 text tokens after it
    assert sched.encoder_cache.refs["img1"] == set(), "img1's run is computed: its reference is gone"


def test_an_image_larger_than_the_step_budget_is_encoded_alone_and_read_in_slices():
    sched = make(budget=8, capacity=100)
    sched.add_request(request("a", 2, [("big", 20)]))
    out = sched.schedule()
    assert out.encoder_inputs == {"a": [0]} and out.num_scheduled_tokens == {"a": 8}
    finish_step(sched, out)
    for expected in (8, 8):  # the rest of the image's run, read from the cache in later chunks
        out = sched.schedule()
        assert out.encoder_inputs == {} and out.num_scheduled_tokens == {"a": expected}
        finish_step(sched, out)


def test_the_same_image_in_one_step_is_encoded_once_and_found_later():
    sched = make(budget=64, capacity=100)
    sched.add_request(request("a", 2, [("same", 10)]))
    sched.add_request(request("b", 5, [("same", 10)]))
    out = sched.schedule()
    assert out.encoder_inputs == {"a": [0]}
    assert sched.encoder_cache.refs["same"] == {"a", "b"}
    assert sched.encoder_cache.num_encoded == 1 and sched.encoder_cache.num_hits == 1


def test_full_cache_of_referenced_images_waits_and_unreferenced_ones_are_evicted_lru():
    sched = make(budget=100, capacity=24)
    sched.add_request(request("a", 1, [("x", 12)], max_tokens=3))
    sched.add_request(request("b", 1, [("y", 12)], max_tokens=3))
    sched.add_request(request("c", 1, [("z", 12)], max_tokens=3))
    out = sched.schedule()
    # x and y fill the cache and are still read; c may compute its text token, then must wait
    assert out.encoder_inputs == {"a": [0], "b": [0]}
    assert out.num_scheduled_tokens["c"] == 1
    finish_step(sched, out)  # a and b computed their images: unreferenced now, still cached
    out = sched.schedule()
    assert out.encoder_inputs == {"c": [0]}
    assert out.freed_encoder_hashes == ["x"], "least recently used first"
    assert sched.encoder_cache.used == 24 and set(sched.encoder_cache.entries) == {"y", "z"}


def test_an_image_larger_than_the_cache_is_refused_at_admission():
    sched = make(budget=100, capacity=8)
    try:
        sched.add_request(request("a", 1, [("huge", 9)]))
    except ValueError as exc:
        assert "9 embeddings, more than the encoder cache holds (8)" in str(exc)
    else:
        raise AssertionError("an image the cache cannot hold must be refused")


def test_preempted_in_the_step_that_planned_its_image_hands_it_over_or_unplans_it():
    from ember.sched.encoder_planner import EncoderPlanner

    cache = EncoderCacheManager(100)
    planner = EncoderPlanner(cache, 64)
    planner.start_step()
    a, b = request("a", 1, [("shared", 8), ("own", 4)]), request("b", 2, [("shared", 8)])
    requests = {"a": a, "b": b}
    for r in (a, b):
        num_new, to_encode = planner.fit(r, 0, r.num_prompt_tokens)
        planner.commit(r, 0, num_new, to_encode)
    assert planner.encode == {"a": [0, 1]} and cache.refs["shared"] == {"a", "b"}
    planner.drop(a, {"a": 15, "b": 12}, requests)  # a is preempted in this step
    assert planner.encode == {"b": [0]}, "b still reads 'shared': it encodes it now"
    assert set(cache.entries) == {"shared"} and cache.used == 8, "'own' is read by no one: un-allocated"
    assert cache.refs["shared"] == {"b"}


def test_block_digests_differ_by_image_and_chain_past_it():
    kv = KVCacheManager(32, 4, enable_prefix_caching=True)
    ids = [1, 2, 3, 4] + [IMAGE] * 8 + [5, 6, 7, 8, 9]
    first = (item("cat", 4, 8),)
    kv.allocate_slots("r1", len(ids))
    kv.cache_full_blocks("r1", ids, len(ids), mm_items=first)
    assert len(kv.find_cached_prefix(ids, mm_items=first)) == 4  # all full blocks but the last token's
    other = (item("dog", 4, 8),)
    assert len(kv.find_cached_prefix(ids, mm_items=other)) == 1, "only the text block before the image"
    assert len(kv.find_cached_prefix(ids)) == 1, "no image hashes: never the image's blocks"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.lists(st.sampled_from("abcde"), min_size=0, max_size=3),
                          st.integers(0, 3)), min_size=1, max_size=6),
       st.integers(6, 40), st.integers(10, 40), st.integers(12, 40))
def test_random_workloads_keep_the_encoder_cache_consistent(prompts, budget, capacity, num_blocks):
    """Random prompts, priorities and pools (small ones preempt): whatever the cache says the
    runner holds, a runner that followed the steps holds, and every image a chunk reads is held."""
    sched = make(budget=budget, capacity=capacity, num_blocks=num_blocks, block_size=4)
    for k, (before, names, priority) in enumerate(prompts):
        r = request(f"r{k}", before, [(n, 5 + "abcde".index(n)) for n in names], max_tokens=6)
        r.priority = priority
        try:
            sched.add_request(r)
        except ValueError:
            pass  # larger than the encoder cache or the KV pool: refused, as tested above
    held: set[str] = set()  # what a runner mirroring the steps would hold
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        held -= set(out.freed_encoder_hashes)
        for rid, indices in out.encoder_inputs.items():
            held |= {sched.requests[rid].mm_items[i].content_hash for i in indices}
        for rid, n in out.num_scheduled_tokens.items():  # every image a chunk reads is held
            r = sched.requests[rid]
            for it in r.mm_items:
                if it.offset < r.num_computed_tokens + n and r.num_computed_tokens < it.end:
                    assert it.content_hash in held
        cache = sched.encoder_cache
        assert set(cache.entries) <= held and cache.used == sum(cache.entries.values()) <= cache.capacity
        finish_step(sched, out)
    assert not sched.has_unfinished_requests()
