"""How many tokens, at the fewest, lead from each state of a token-level DFA to a valid end.

outlines-core compiles a constraint into an ``Index``: states, the tokens allowed in each
with the state each leads to, and final states (where the output may end). The engine
closes a constrained output within its budget (docs/grammar.md, "Outputs that always
close") from two numbers per state: its distance to an end, and per allowed token the
distance of the state that token leads to.

The distance counts the final EOS: 1 in a final state, ``1 + min(distance(next))``
elsewhere, unreachable states (none in a pruned index) infinite. It is one breadth-first
search backwards from the final states, over the states' distinct successors, done once
per compiled grammar on the compile thread. Each state's allowed tokens are kept sorted
by the distance they lead to, so the tokens from which the output can still end within
``k`` tokens are a prefix found by binary search.

Grammars whose index holds more than `MAX_TRANSITIONS` token transitions are not
measured (None): the search holds a copy of the transitions, and an index that large
(a long free-text schema over a big vocabulary) would cost memory out of proportion.
Measuring costs about a third of building the index (SmolLM2's vocabulary: 32 ms for a
200-state order schema, 220 ms for a 50-property one with 0.9 million transitions), on
the compile thread, once per compiled grammar.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

# transitions measured at most (about 20 bytes each while measuring, 6 after)
MAX_TRANSITIONS = 8_000_000
UNREACHABLE = np.iinfo(np.int16).max


@dataclass(frozen=True)
class StateRow:
    """One state's allowed tokens (EOS excluded), ascending by the distance of the
    state each leads to (``distances``, int16, `UNREACHABLE` where no end is reachable)."""

    tokens: np.ndarray
    distances: np.ndarray

    def within(self, limit: int) -> np.ndarray:
        """The tokens that lead to a state at distance ``limit`` or less."""
        return self.tokens[: int(np.searchsorted(self.distances, limit, side="right"))]

    @property
    def max_distance(self) -> int:
        return int(self.distances[-1]) if self.distances.size else 0


class TokenDistances:
    """Per state: its distance to an end (`distance`) and its `StateRow`."""

    def __init__(self, distance: dict[int, int], rows: dict[int, StateRow]) -> None:
        self._distance = distance
        self._rows = rows

    def distance(self, state: int) -> int:
        return self._distance.get(state, int(UNREACHABLE))

    def row(self, state: int) -> StateRow:
        return self._rows.get(state) or StateRow(np.zeros(0, np.int32), np.zeros(0, np.int16))


def measure(
    transitions: Mapping[int, Mapping[int, int]], final_states: Iterable[int], eos_token_ids: Iterable[int],
    max_transitions: int = MAX_TRANSITIONS,
) -> TokenDistances | None:
    """Distances of the DFA ``transitions`` (state -> token -> next state) with
    ``final_states``; EOS tokens in ``transitions`` are left out (EOS is the end
    itself). None when it holds more than ``max_transitions`` transitions."""
    if sum(len(row) for row in transitions.values()) > max_transitions:
        return None
    eos = set(eos_token_ids)
    predecessors: dict[int, set[int]] = {}
    for state, row in transitions.items():
        for nxt in set(row.values()):
            predecessors.setdefault(nxt, set()).add(state)
    distance = {state: 1 for state in final_states}
    frontier = list(distance)
    level = 1
    while frontier:
        level += 1
        reached = []
        for state in frontier:
            for before in predecessors.get(state, ()):
                if before not in distance:
                    distance[before] = level
                    reached.append(before)
        frontier = reached
    # distances by state id in one array, for a vectorized lookup per row
    states = set(transitions) | set(predecessors) | set(distance)
    if max(states, default=0) > 4 * max_transitions:
        return None  # sparse ids too large for the lookup array (outlines-core numbers its states densely)
    by_id = np.full(max(states, default=0) + 1, UNREACHABLE, dtype=np.int16)
    for state, d in distance.items():
        by_id[state] = min(d, UNREACHABLE)
    eos_ids = np.array(sorted(eos), dtype=np.int64)
    rows = {}
    for state, row in transitions.items():
        tokens = np.fromiter(row.keys(), np.int64, len(row))
        nexts = np.fromiter(row.values(), np.int64, len(row))
        keep = ~np.isin(tokens, eos_ids)
        tokens, dists = tokens[keep].astype(np.int32), by_id[nexts[keep]]
        order = np.argsort(dists, kind="stable")
        rows[state] = StateRow(tokens[order], dists[order])
    return TokenDistances(distance, rows)
