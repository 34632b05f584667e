"""``ngram``: prompt lookup decoding. The last ``n`` tokens of a request (``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up among its earlier
tokens, prompt and output; the tokens that followed their latest earlier occurrence
are proposed. It costs no model and pays where the output copies its input: editing
code, quoting a passage, extracting fields.

Each request keeps an index from every ``n``-gram to the position after its latest
occurrence, updated by the tokens appended since the last step (amortized O(1) per
token and ``n``), so a step's lookup does not scan the context."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.plugin import hookimpl
from ember.plugin.speculator import BaseSpeculator, Proposal, SpecRequest, SpeculatorContext


@dataclass(slots=True)
class _Index:
    prompt_len: int
    tokens: list[int] = field(default_factory=list)  # the request's tokens indexed so far
    # n -> {n-gram: position right after its latest occurrence that ended before the last token}
    grams: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    num_indexed: int = 0  # positions p < num_indexed have had their ending n-grams recorded


class NgramSpeculator(BaseSpeculator):
    name = "ngram"

    def __init__(self, context: SpeculatorContext) -> None:
        super().__init__(context)
        config = context.config
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min
        self._indexes: dict[str, _Index] = {}

    def _index(self, request: SpecRequest) -> _Index:
        index = self._indexes.get(request.request_id)
        prompt, output = request.prompt_token_ids, request.output_token_ids
        if index is None or index.prompt_len != len(prompt) or len(index.tokens) > request.num_tokens:
            index = self._indexes[request.request_id] = _Index(len(prompt), list(prompt),
                                                               {n: {} for n in range(self.n_min, self.n_max + 1)})
        have = len(index.tokens) - index.prompt_len
        if have < len(output):
            index.tokens.extend(output[have:])
        tokens = index.tokens
        # record the n-grams ending at every position before the last one (the last
        # is the suffix looked up: its own occurrence would match itself)
        for end in range(index.num_indexed, len(tokens) - 1):
            for n, grams in index.grams.items():
                if end + 1 >= n:
                    grams[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        index.num_indexed = max(index.num_indexed, len(tokens) - 1)
        return index

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        proposals = []
        for request in requests:
            index = self._index(request)
            tokens, k = index.tokens, request.max_drafts
            draft: list[int] = []
            for n in range(self.n_max, self.n_min - 1, -1):
                if len(tokens) <= n:
                    continue
                after = index.grams[n].get(tuple(tokens[-n:]))
                if after is not None:
                    draft = tokens[after : after + k]
                    break
            proposals.append(Proposal(draft))
        return proposals

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


@hookimpl
def ember_register_speculators(registry) -> None:
    registry.register("ngram", NgramSpeculator)
