"""Suffix decoding (ember.plugins.speculative.suffix): the suffix tree (incremental
growth equal to a rebuild and to counting substrings directly, removal), proposals on
hand-made sequences (repeated code, a quoted passage), the frequency-based choice
between branches, the probability cut-off, the speculation length scaling with the
match, the global tree's bound, the config's checks, the contract, and greedy outputs
equal to those without speculation on the tiny model."""

from __future__ import annotations

import random

import pytest

from ember import LLM, SamplingParams
from ember.config import SpeculativeConfig
from ember.plugin.speculator import SpecRequest, SpeculatorContext
from ember.plugins.speculative.ngram import NgramSpeculator
from ember.plugins.speculative.suffix import Sequence, SuffixSpeculator, SuffixTree
from ember.testing import check_speculator

# cost_aware off: the tests are of the speculator, not of the decoder's step-cost model
SUFFIX = {"method": "suffix", "num_speculative_tokens": 16, "disable_by_batch_size": None,
          "min_acceptance_rate": 0.0, "cost_aware": False}


def _suffix(**config) -> SuffixSpeculator:
    return SuffixSpeculator(SpeculatorContext(SpeculativeConfig(**{**SUFFIX, **config}), 100_000, ()))


class Words:
    """A word-level 'tokenizer' for hand-made sequences."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        return [self.ids.setdefault(word, len(self.ids) + 1) for word in text.split()]


def _propose(spec, prompt, output=(), max_drafts=16, request_id="a") -> list[int]:
    return spec.propose([SpecRequest(request_id, list(prompt), list(output), max_drafts, 0.0)])[0].token_ids


def _substring_counts(sequences, depth) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                counts[tuple(seq[i:j])] = counts.get(tuple(seq[i:j]), 0) + 1
    return counts


def _check_best_children(tree: SuffixTree) -> None:
    kids: dict[int, list[int]] = {}
    for key, child in tree.edges.items():
        kids.setdefault(key >> 32, []).append(child)
    for node, children in kids.items():
        assert tree.count[tree.best[node]] == max(tree.count[c] for c in children)


# -- the tree -----------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [2, 5, 24])
def test_the_tree_grown_incrementally_equals_a_rebuild_and_the_substring_counts(depth):
    rng = random.Random(depth)
    tokens = [rng.choice([1, 2, 3, 4]) for _ in range(300)]
    whole = SuffixTree(depth)
    whole.extend(Sequence(), tokens)
    pieces, seq, at = SuffixTree(depth), Sequence(), 0
    while at < len(tokens):
        step = rng.choice([1, 1, 2, 7, 30])
        pieces.extend(seq, tokens[at : at + step])
        at += step
    assert seq.tokens == tokens and len(seq.active) == min(len(tokens), depth - 1)
    expected = _substring_counts([tokens], depth)
    assert whole.paths() == pieces.paths() == expected
    assert whole.best == pieces.best and whole.count[0] == len(tokens)
    _check_best_children(pieces)


def test_the_speculator_grown_step_by_step_proposes_what_a_fresh_one_does():
    rng = random.Random(7)
    base = [rng.randrange(1, 30) for _ in range(40)]
    tokens = base + base[:25] + [rng.randrange(1, 30) for _ in range(20)] + base[10:40]
    prompt, output = tokens[:50], tokens[50:]
    growing = _suffix()
    for n in range(len(output) + 1):
        assert _propose(growing, prompt, output[:n]) == _propose(_suffix(), prompt, output[:n], request_id="b"), n


def test_a_removable_tree_takes_sequences_back_out():
    rng = random.Random(3)
    seqs = [[rng.choice([1, 2, 3]) for _ in range(rng.randrange(1, 60))] for _ in range(6)]
    tree = SuffixTree(6, removable=True)
    for seq in seqs:
        tree.extend(Sequence(), seq)
    assert tree.paths() == _substring_counts(seqs, 6)
    for i in (4, 0, 2):
        tree.remove(seqs[i])
    kept = [seqs[i] for i in (1, 3, 5)]
    assert tree.paths() == _substring_counts(kept, 6)
    _check_best_children(tree)
    for seq in kept:
        tree.remove(seq)
    assert tree.paths() == {} and tree.num_nodes == 1 and tree.count[0] == 0


# -- proposals ----------------------------------------------------------------------------------

CODE = ("def load ( path ) : NL with open ( path ) as handle : NL data = json . load ( handle ) NL"
        " if ' name ' not in data : NL raise KeyError ( ' no name ' ) NL return data NL")
PASSAGE = ("The lighthouse at Point Reyes was built in 1870 to warn ships away from the headland , one of the "
           "foggiest places on the Pacific coast .")


def test_repeated_code_is_proposed_from_where_the_output_left_it():
    words = Words()
    code = words(CODE)
    prompt = words("Rename load to read and return the code :") + code + words("Answer :")
    output = words("def read ( path ) : NL with open")
    after = code[code.index(words("open")[0]) + 1 :]
    spec = _suffix(suffix_decoding_max_spec_factor=2.0, suffix_decoding_max_spec_offset=1.0)
    # the longest match that occurred before is "( path ) : NL with open" (7 tokens; "read" is new):
    # up to 2 * 7 + 1 = 15 drafts, every one the code's
    assert _propose(spec, prompt, output) == after[:15]
    # with the default factor 1 a 7-token match proposes 7; num_speculative_tokens caps it as well
    assert _propose(_suffix(), prompt, output) == after[:7]
    assert _propose(spec, prompt, output, max_drafts=2) == after[:2]


def test_a_quoted_passage_is_proposed_while_the_quote_follows_it():
    words = Words()
    passage = words(PASSAGE)
    prompt = words("Quote the sentence about the lighthouse :") + passage + words("Answer :")
    spec = _suffix(suffix_decoding_max_tree_depth=32, suffix_decoding_max_spec_factor=4.0)
    start = passage.index(words("built")[0])
    # the quote so far is matched (7 tokens): min(4 * 7, depth 32 - 7) = 25 drafts, the rest of the
    # passage and, past its end, what followed it in the request ("Answer :" and the quote's start)
    output = passage[:start + 1]
    draft = _propose(spec, prompt, output, max_drafts=30)
    assert draft == (passage[start + 1 :] + words("Answer :") + passage)[:25]
    # n-gram lookup (its longest suffix 4) proposes the same run, capped at its k
    ngram = NgramSpeculator(SpeculatorContext(SpeculativeConfig(method="ngram", num_speculative_tokens=5), 100_000, ()))
    assert ngram.propose([SpecRequest("a", prompt, output, 5, 0.0)])[0].token_ids == draft[:5]
    # nothing repeats: nothing proposed
    assert _propose(spec, words("a fresh sentence"), request_id="c") == []


def test_the_most_frequent_branch_is_followed_where_ngram_takes_the_latest():
    # after [1, 2]: 3 three times, then 4 once (the latest)
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3, 7, 1, 2, 4, 6, 1, 2]
    spec = _suffix(suffix_decoding_max_spec_factor=4.0)
    assert _propose(spec, tokens, max_drafts=1) == [3]
    ngram = NgramSpeculator(SpeculatorContext(SpeculativeConfig(method="ngram", prompt_lookup_max=2), 100_000, ()))
    assert ngram.propose([SpecRequest("a", tokens, [], 1, 0.0)])[0].token_ids == [4]
    # after 3 came 9, 8 and 7 once each: P = 3/4 * 1/3 = 0.25, the latest of the tie (7), then 1 (P = 0.25)
    assert _propose(spec, tokens, max_drafts=3, request_id="b") == [3, 7, 1]


def test_drafts_stop_where_the_estimated_probability_falls_below_min_token_prob():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3, 7, 1, 2, 4, 6, 1, 2]
    for min_prob, expected in [(0.25, [3, 7, 1]), (0.3, [3]), (0.75, [3]), (0.8, [])]:
        spec = _suffix(suffix_decoding_max_spec_factor=4.0, suffix_decoding_min_token_prob=min_prob)
        assert _propose(spec, tokens, max_drafts=3) == expected, min_prob


def test_match_plus_drafts_fit_the_trees_depth():
    tokens = list(range(1, 21)) * 2 + [1, 2, 3, 4, 5, 6]
    spec = _suffix(suffix_decoding_max_tree_depth=8, suffix_decoding_max_spec_factor=4.0)
    # a 7-token match (depth - 1) leaves room for 1 draft, a 2-token one for 6 (factor 4 allows 8): the
    # draft with the most expected accepted tokens wins
    assert _propose(spec, tokens) == [7, 8, 9, 10, 11, 12]
    assert _propose(_suffix(suffix_decoding_max_tree_depth=8, suffix_decoding_max_spec_factor=1.0), tokens,
                    request_id="c") == [7, 8, 9, 10]  # a 4-token match: 4 drafts (4 more room)
    assert _propose(_suffix(suffix_decoding_max_tree_depth=8, suffix_decoding_max_spec_factor=0.0,
                            suffix_decoding_max_spec_offset=2.0), tokens, request_id="b") == [7, 8]


# -- the global tree ----------------------------------------------------------------------------

def test_the_global_tree_holds_the_latest_responses_only_and_proposes_from_them():
    spec = _suffix(suffix_decoding_max_cached_requests=2, suffix_decoding_max_spec_factor=4.0)
    rng = random.Random(5)
    responses = [rng.sample(range(100 * i + 100, 100 * i + 200), 30) for i in range(5)]  # no token shared
    for i, response in enumerate(responses):
        _propose(spec, [1, 2, 3], response, request_id=f"r{i}")
        spec.release(f"r{i}")
        assert "r%d" % i not in spec._requests
    assert list(spec._cached) == ["r3", "r4"]
    assert spec.global_tree.paths() == _substring_counts(responses[3:], spec.depth)
    assert spec.global_tree.num_nodes == 1 + len(_substring_counts(responses[3:], spec.depth))
    # a new request repeating a cached response gets it as drafts; an evicted one's does not
    assert _propose(spec, [5, 6], responses[4][:4], request_id="n") == responses[4][4:20]
    assert _propose(spec, [5, 6], responses[0][:4], request_id="m") == []
    # a request released twice (preempted, then finished) is cached once, with its longer response
    _propose(spec, [1], responses[0][:10], request_id="p")
    spec.release("p")
    _propose(spec, [1], responses[0], request_id="p")
    spec.release("p")
    assert list(spec._cached) == ["r4", "p"]
    assert spec.global_tree.paths() == _substring_counts([responses[4], responses[0]], spec.depth)


def test_without_cached_requests_there_is_no_global_tree_and_release_frees_the_request():
    spec = _suffix()
    _propose(spec, [1, 2, 1], [2])
    assert spec.global_tree is None and "a" in spec._requests
    spec.release("a")
    spec.release("never-seen")
    assert spec._requests == {}


# -- config and contract ------------------------------------------------------------------------

@pytest.mark.parametrize("bad,message", [
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 1}', "suffix_decoding_max_tree_depth .* got 1"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 8.5}', "suffix_decoding_max_tree_depth .* got 8.5"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}', "suffix_decoding_max_cached_requests .* -1"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "suffix_decoding_min_token_prob .* got 1.5"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": -0.5}', "suffix_decoding_max_spec_factor .* -0.5"),
    ('{"method": "suffix", "suffix_decoding_max_spec_offset": "2"}', "suffix_decoding_max_spec_offset .* '2'"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": Infinity}', "suffix_decoding_max_spec_factor .* inf"),
])
def test_the_config_names_a_bad_suffix_option(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(bad)


def test_suffix_keeps_the_speculator_contract(tmp_path):
    check_speculator(SuffixSpeculator, tmp_path, config={"num_speculative_tokens": 8})


def test_suffix_with_the_global_tree_keeps_the_speculator_contract(tmp_path):
    check_speculator(SuffixSpeculator, tmp_path, config={"num_speculative_tokens": 8,
                                                         "suffix_decoding_max_cached_requests": 3,
                                                         "suffix_decoding_max_spec_factor": 2.0})


def test_greedy_outputs_with_suffix_equal_those_without_and_later_requests_use_earlier_responses(tiny_llama_dir):
    """Through the entry point (method "suffix"), in batch-invariant mode. The random
    tiny model's outputs seldom repeat themselves; sent again, the same prompts find
    their earlier responses in the global tree, and most tokens come as accepted drafts."""
    args = dict(dtype="float32", num_kv_tokens=2048, max_model_len=256, backend_options={"batch_invariant": "1"})
    prompts = [[(i % 7) + 10 for i in range(40)], list(range(60, 90)) + list(range(60, 75)), [5, 6, 7] * 3]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), **args)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    config = {**SUFFIX, "suffix_decoding_max_cached_requests": 8}
    spec = LLM(str(tiny_llama_dir), speculative_config=config, **args)
    stats = spec.engine.core.speculator.stats
    accepted = []
    for _ in range(2):
        before = stats.num_accepted_tokens
        got = [o.outputs[0].token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == expected
        accepted.append(stats.num_accepted_tokens - before)
    speculator = spec.engine.core.speculator.speculator
    assert isinstance(speculator, SuffixSpeculator)
    assert accepted[1] >= max(72, 3 * accepted[0]), (accepted, stats)  # half the 144 tokens at least
    assert len(speculator._cached) == 6 and speculator._requests == {}
