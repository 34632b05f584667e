"""``suffix``: suffix decoding (Snowflake's Arctic Inference method, vLLM's ``suffix``;
"SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications").

Each request keeps a suffix tree over its prompt and its own output: every substring
of at most ``suffix_decoding_max_tree_depth`` tokens is a path from the root, and each
node counts how often its path occurs. A step matches the longest suffixes of the
request's tokens against the tree and, from the node a match ends at, follows the
child seen most often while the estimated probability of the whole draft (each
child's count over its parent's, multiplied along the path) stays at or above
``suffix_decoding_min_token_prob``; a match of ``m`` tokens may propose up to
``suffix_decoding_max_spec_factor * m + suffix_decoding_max_spec_offset`` drafts (a
long match is good evidence), and match plus drafts fit the tree's depth. Of the
drafts each match length gives, the one with the most expected accepted tokens (the
sum of its cumulative probabilities) is proposed. Where n-gram lookup proposes what
followed the latest occurrence of a fixed-length suffix, this weighs every earlier
occurrence, so a pattern seen often (a JSON key, a tool call's arguments, a line of
code) proposes its usual continuation and a rare branch is not followed.

With ``suffix_decoding_max_cached_requests`` above 0, a global tree also holds the
outputs of that many earlier requests (the oldest evicted first, its counts taken
back out), so that agentic loops that repeat earlier responses get drafts from them.

The trees grow incrementally: a token appended to a sequence extends the (at most
``depth - 1``) suffixes still shorter than the depth by one node each, so a step
costs O(new tokens x depth), never a rebuild. A request's tree is dropped in
``release``; its size is at most its tokens x depth nodes, and the global tree's at
most the cached responses' tokens x depth.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ember.plugin import hookimpl
from ember.plugin.speculator import BaseSpeculator, Proposal, SpecRequest, SpeculatorContext

_BASE = 1 << 32  # an edge's key: parent * _BASE + token (token ids are below 2**32)


@dataclass(slots=True)
class Sequence:
    """A sequence being added to a tree: its tokens and the nodes that end its
    suffixes still shorter than the tree's depth, oldest (deepest) first."""

    tokens: list[int] = field(default_factory=list)
    active: list[int] = field(default_factory=list)


class SuffixTree:
    """Every substring of at most ``depth`` tokens of the sequences added, as a path
    from the root (node 0), each node counting the occurrences of its path.

    Nodes live in flat lists (count, token, most frequent child) and edges in one
    dict, which costs far less memory than an object per node. ``removable`` trees
    (the global one) also keep each node's parent and children, so that a sequence's
    counts can be taken out again."""

    def __init__(self, depth: int, removable: bool = False) -> None:
        self.depth = depth
        self.count = [0]
        self.token = [-1]
        self.best = [-1]  # the child with the highest count (the latest one to reach it on a tie); -1: none
        self.edges: dict[int, int] = {}
        self.parent: list[int] | None = [-1] if removable else None
        self.children: list[list[int]] | None = [[]] if removable else None
        self._free: list[int] = []

    @property
    def num_nodes(self) -> int:
        """Nodes in use, the root included."""
        return len(self.count) - len(self._free)

    def _new_node(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self.count[node], self.token[node], self.best[node] = 0, token, -1
        else:
            node = len(self.count)
            self.count.append(0)
            self.token.append(token)
            self.best.append(-1)
            if self.parent is not None:
                self.parent.append(parent)
                self.children.append([])
        if self.parent is not None:
            self.parent[node] = parent
            self.children[node] = []
            self.children[parent].append(node)
        self.edges[parent * _BASE + token] = node
        return node

    def extend(self, seq: Sequence, tokens: list[int]) -> None:
        """Append ``tokens`` to ``seq``: every suffix of it shorter than the depth,
        and a new one from the root, grows by each token."""
        count, best, edges, depth = self.count, self.best, self.edges, self.depth
        active = seq.active
        for token in tokens:
            count[0] += 1
            active.append(0)
            grown = []
            for parent in active:
                node = edges.get(parent * _BASE + token)
                if node is None:
                    node = self._new_node(parent, token)
                count[node] += 1
                top = best[parent]
                if top < 0 or count[node] >= count[top]:
                    best[parent] = node
                grown.append(node)
            active = grown[1:] if len(grown) >= depth else grown
        seq.active = active
        seq.tokens.extend(tokens)

    def remove(self, tokens: list[int]) -> None:
        """Take a sequence added with ``extend`` back out (a removable tree only):
        every suffix's path loses one count, nodes at zero go."""
        assert self.parent is not None, "remove needs a removable tree"
        for start in range(len(tokens)):
            path, node = [], 0
            for token in tokens[start : start + self.depth]:
                node = self.edges[node * _BASE + token]
                path.append(node)
            self.count[0] -= 1
            for node in reversed(path):
                self._decrement(node)

    def _decrement(self, node: int) -> None:
        parent = self.parent[node]
        self.count[node] -= 1
        if self.count[node] == 0:
            del self.edges[parent * _BASE + self.token[node]]
            self.children[parent].remove(node)
            self.children[node] = []
            self._free.append(node)
        if self.best[parent] == node:
            kids = self.children[parent]
            self.best[parent] = max(kids, key=self.count.__getitem__) if kids else -1

    def find(self, tokens: list[int]) -> int:
        """The node of the path ``tokens``; -1 if it never occurred."""
        node = 0
        for token in tokens:
            node = self.edges.get(node * _BASE + token, -1)
            if node < 0:
                return -1
        return node

    def matches(self, context: list[int], longest: int, own: int = 0) -> list[tuple[int, int]]:
        """``(m, node)`` for each suffix of ``context`` of ``m = 1 .. longest`` tokens
        that occurs in the tree more than ``own`` times (the context's own suffix, in
        a request's tree). A longer suffix occurs at most as often as a shorter one,
        so they stop at the first one that does not."""
        found = []
        for m in range(1, min(longest, len(context)) + 1):
            node = self.find(context[-m:])
            if node < 0 or self.count[node] <= own:
                break
            found.append((m, node))
        return found

    def draft(self, node: int, own: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent child from ``node`` while the product of the
        children's count ratios stays at or above ``min_prob``, for at most ``limit``
        tokens: the tokens and the sum of their cumulative probabilities (the expected
        number accepted). ``own``: occurrences of ``node``'s path that cannot continue
        (the context's own suffix, the last thing in a request's tree)."""
        count, best, token = self.count, self.best, self.token
        total = count[node] - own
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit and total > 0:
            child = best[node]
            if child < 0:
                break
            prob *= count[child] / total
            if prob < min_prob:
                break
            out.append(token[child])
            score += prob
            node, total = child, count[child]
        return out, score

    def paths(self) -> dict[tuple[int, ...], int]:
        """Every path in the tree with its count (for tests and debugging)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]
        kids: dict[int, list[int]] = {}
        for key, child in self.edges.items():
            kids.setdefault(key // _BASE, []).append(child)
        while stack:
            node, path = stack.pop()
            for child in kids.get(node, ()):
                sub = path + (self.token[child],)
                out[sub] = self.count[child]
                stack.append((child, sub))
        return out


@dataclass(slots=True)
class _RequestTree:
    prompt_len: int
    tree: SuffixTree
    seq: Sequence


class SuffixSpeculator(BaseSpeculator):
    name = "suffix"

    def __init__(self, context: SpeculatorContext) -> None:
        super().__init__(context)
        config = context.config
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.spec_offset = config.suffix_decoding_max_spec_offset
        self.min_prob = config.suffix_decoding_min_token_prob
        self._requests: dict[str, _RequestTree] = {}
        self.global_tree = SuffixTree(self.depth, removable=True) if self.max_cached else None
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # request id -> its response in the global tree

    def _tree(self, request: SpecRequest) -> _RequestTree:
        state = self._requests.get(request.request_id)
        prompt, output = request.prompt_token_ids, request.output_token_ids
        if state is None or state.prompt_len != len(prompt) or len(state.seq.tokens) > request.num_tokens:
            state = self._requests[request.request_id] = _RequestTree(len(prompt), SuffixTree(self.depth), Sequence())
            state.tree.extend(state.seq, prompt)
        have = len(state.seq.tokens) - state.prompt_len
        if have < len(output):
            state.tree.extend(state.seq, output[have:])
        return state

    def _limit(self, m: int, max_drafts: int) -> int:
        by_match = self.spec_factor * m + self.spec_offset
        return max(0, min(max_drafts, self.depth - m, int(min(by_match, max_drafts))))

    def best_draft(self, context: list[int], tree: SuffixTree, max_drafts: int, own: int,
                   best: tuple[list[int], float] = ([], 0.0)) -> tuple[list[int], float]:
        """The draft with the highest expected accepted length over every suffix of
        ``context`` matched in ``tree``. ``best``: the one to beat (the request's own
        tree's, for the global tree), kept on a tie; within a tree the longer match
        wins a tie."""
        beat = best[1]
        for m, node in tree.matches(context, self.depth - 1, own):
            limit = self._limit(m, max_drafts)
            if limit:
                tokens, score = tree.draft(node, own, limit, self.min_prob)
                if tokens and score > beat and score >= best[1]:
                    best = (tokens, score)
        return best

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        proposals = []
        for request in requests:
            state = self._tree(request)
            tokens = state.seq.tokens
            best = self.best_draft(tokens, state.tree, request.max_drafts, own=1)
            if self.global_tree is not None:
                best = self.best_draft(tokens, self.global_tree, request.max_drafts, own=0, best=best)
            proposals.append(Proposal(best[0]))
        return proposals

    def release(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if self.global_tree is None or state is None:
            return
        # a preempted request comes back and is released again: its longer response replaces this one
        old = self._cached.pop(request_id, None)
        if old is not None:
            self.global_tree.remove(old)
        response = state.seq.tokens[state.prompt_len :]
        if not response:
            return
        self.global_tree.extend(Sequence(), response)
        self._cached[request_id] = response
        while len(self._cached) > self.max_cached:
            _, evicted = self._cached.popitem(last=False)
            self.global_tree.remove(evicted)


@hookimpl
def ember_register_speculators(registry) -> None:
    registry.register("suffix", SuffixSpeculator)
