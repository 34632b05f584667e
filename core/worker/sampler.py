"""Turn one step's logits of a whole batch into token ids, on the logits' device.

Core does the standard controls itself, as tensor operations over the rows that use
each one (an operation no row uses does not run), in transformers' `generate` order,
with the plugins' processors (:class:`ember.worker.logits_pipeline.LogitsPipeline`) run
between its steps by their ``order``:

1. adjustments, greedy rows included: ``logit_bias``, repetition penalty
   (transformers' semantics over prompt and output), frequency / presence penalty
   (OpenAI's, over the output), bad words, ``min_tokens`` (no EOS or stop token yet);
2. processors with ``order < ORDER_TEMPERATURE``;
3. temperature (sampled rows only, as every step below);
4. processors in ``[ORDER_TEMPERATURE, ORDER_TRUNCATE)``;
5. top-k, top-p, min-p;
6. processors with ``order >= ORDER_TRUNCATE`` (typical-p);
7. ``repair_non_finite``; then greedy rows take the argmax and sampled rows draw
   from the softmax by inverting its CDF at one uniform number a row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import torch

from ember.logprobs import PositionLogprobs, compute_position_logprobs
from ember.plugin.logits_processor import ORDER_TEMPERATURE, ORDER_TRUNCATE, SamplingRow
from ember.sampling_params import SamplingParams, position_seed
from ember.worker.logits_pipeline import LogitsPipeline

__all__ = ["Sampler", "SamplerOutput", "SamplingRow"]

NEG_INF = float("-inf")

GreedyOp = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
RowOp = Callable[[torch.Tensor, list[SamplingRow]], torch.Tensor]


@dataclass(slots=True)
class SamplerOutput:
    """One token per row; ``processed`` is the ``(rows, vocab)`` float32 logits it was
    drawn from (for greedy rows: after the adjustments only), for top-logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    processed: torch.Tensor


class Sampler:
    """Stateful only in the per-request generators and in the pipeline's processors.
    Not thread-safe except :meth:`validate`.

    A seeded request's draws for its ``i``-th output token come from a generator
    seeded with ``(seed, i)`` (:func:`position_seed`), not from one stream run
    through: its tokens then depend neither on its batch mates nor on how its steps
    fell — a recomputation after preemption, a prefix-cache hit, or how many draft
    tokens a step verified. A deterministic speculator (n-gram, argmax heads) thus
    leaves a seeded request's sampled tokens exactly as they are without it."""

    def __init__(
        self, vocab_size: int | None = None, seed: int | None = None,
        greedy_op: GreedyOp | None = None, pipeline: LogitsPipeline | None = None,
    ) -> None:
        # vocab_size: the logits' width, for validate's token-id checks (None: unchecked)
        self.vocab_size = vocab_size
        self.seed = seed
        # greedy_op(logits) -> (ids, logprobs): the backend's fused argmax and
        # log-softmax of it (BaseBackend.greedy_op), else PyTorch's
        self.greedy_op = greedy_op
        self.pipeline = pipeline if pipeline is not None else LogitsPipeline([])
        self._generators: dict[str, torch.Generator] = {}  # seeded requests
        self._shared: dict[torch.device, torch.Generator] = {}  # the rest, one per device

    def validate(self, params: SamplingParams) -> None:
        """Raise ValueError naming the value if ``params`` cannot be served: a token id
        outside the vocabulary, or what the pipeline refuses. Safe from any thread."""
        if self.vocab_size is not None:
            _check_ids(params.logit_bias, self.vocab_size, "logit_bias")
            for word in params.bad_words_token_ids:
                _check_ids(word, self.vocab_size, "bad_words_token_ids")
            _check_ids(params.stop_token_ids, self.vocab_size, "stop_token_ids")
        if params.uses_plugin_processors:
            self.pipeline.validate(params)

    def remove_request(self, request_id: str) -> None:
        """The request finished or was aborted: drop its generator and processor state."""
        self._generators.pop(request_id, None)
        if request_id in self.pipeline.active:
            self.pipeline.remove_request(request_id)


    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """``logits``: ``(len(rows), vocab)``, owned by the sampler from now on (changed
        in place). Several rows may share a request id (speculative decoding)."""
        if self.greedy_op is not None and logits.dtype == torch.float32 and self._is_plain_greedy(rows):
            # the common decode batch: nothing to process, and the backend's fused
            # argmax never picks NaN, so there is nothing to repair either
            ids, lps = self.greedy_op(logits)
            return SamplerOutput(ids.tolist(), lps.tolist(), logits)
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        return self.draw(self.process(logits.float(), rows), rows)

    def _is_plain_greedy(self, rows: list[SamplingRow]) -> bool:
        """Greedy rows that no adjustment or processor touches."""
        named = False
        for row in rows:
            p = row.params
            if not p.is_unadjusted_greedy or len(row.output_token_ids) < p.min_tokens:
                return False
            named = named or p.uses_plugin_processors
        return not named or not self.pipeline.uses_any(rows)

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Steps 1-7 of the module docstring on float32 ``logits`` (changed in place);
        returns the processed logits, same shape."""
        params = [row.params for row in rows]
        adjustments: tuple[tuple[RowOp, list[int]], ...] = (
            (_logit_bias, [i for i, p in enumerate(params) if p.logit_bias]),
            (_repetition_penalty, [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]),
            (_frequency_presence_penalty,
             [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]),
            (_bad_words, [i for i, p in enumerate(params) if p.bad_words_token_ids]),
            (_min_tokens, [i for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens]),
        )
        for op, indices in adjustments:
            if indices:
                logits = _on_rows(op, logits, rows, indices)
        piped = any(p.uses_plugin_processors for p in params)  # else the pipeline has nothing to do
        if piped:
            logits = self.pipeline.apply(logits, rows, None, ORDER_TEMPERATURE)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled:
            vocab = logits.shape[-1]
            temperature = [i for i in sampled if params[i].temperature != 1.0]
            if temperature:
                logits = _on_rows(_temperature, logits, rows, temperature)
            if piped:
                logits = self.pipeline.apply(logits, rows, ORDER_TEMPERATURE, ORDER_TRUNCATE)
            truncations = (
                (_top_k, [i for i in sampled if 0 < params[i].top_k < vocab]),
                (_top_p, [i for i in sampled if params[i].top_p < 1.0]),
                (_min_p, [i for i in sampled if params[i].min_p > 0.0]),
            )
            for op, indices in truncations:
                if indices:
                    logits = _on_rows(op, logits, rows, indices)
            if piped:
                logits = self.pipeline.apply(logits, rows, ORDER_TRUNCATE, None)
        return repair_non_finite(logits)

    def draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """One token per row of processed ``logits`` and its log-probability under
        the distribution it was drawn from."""
        num_rows, device = len(rows), logits.device
        token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
        logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        if greedy:
            index, sub = _take(logits, greedy)
            if self.greedy_op is not None:
                ids, lps = self.greedy_op(sub)
            else:
                ids = sub.argmax(dim=-1)
                # log p(id) = logit(id) - logsumexp(logits): no full log-softmax per step
                lps = sub.gather(-1, ids[:, None])[:, 0] - sub.logsumexp(dim=-1)
            _put(token_ids, index, ids.to(device))
            _put(logprobs, index, lps.to(device))
        if len(greedy) < num_rows:
            sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
            index, sub = _take(logits, sampled)
            ids = self._inverse_cdf(sub.softmax(dim=-1), [rows[i] for i in sampled])
            lps = sub.gather(-1, ids[:, None])[:, 0] - sub.logsumexp(dim=-1)
            _put(token_ids, index, ids)
            _put(logprobs, index, lps)
        return SamplerOutput(token_ids.tolist(), logprobs.tolist(), logits)

    def _inverse_cdf(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row of ``probs``: the first whose cumulative probability
        (float64) exceeds a uniform number times the row's total. One random number a
        row: the exponential race it replaces drew a vocabulary's worth (64 rows of
        49,152 on a 2-core CPU: 63.5 ms, against 2.3 ms). The unseeded rows' uniforms come in one
        batched draw from the shared generator; each seeded row's from its request's
        generator, in row order, so that its draw never depends on its batch mates. A
        banned token (p = 0) adds nothing to the sum and cannot be drawn."""
        device, vocab = probs.device, probs.shape[-1]
        seeded = [j for j, row in enumerate(rows) if row.params.seed is not None]
        uniform = torch.empty(len(rows), dtype=torch.float64, device=device)
        if len(seeded) < len(rows):
            seeded_set = set(seeded)
            unseeded = [j for j in range(len(rows)) if j not in seeded_set]
            draws = torch.rand(len(unseeded), dtype=torch.float64, generator=self._shared_generator(device),
                               device=device)
            if seeded:
                uniform.index_copy_(0, torch.tensor(unseeded, dtype=torch.int64, device=device), draws)
            else:
                uniform = draws
        for j in seeded:
            uniform[j] = torch.rand(1, dtype=torch.float64, generator=self._request_generator(rows[j], device),
                                    device=device)[0]
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        total = cdf[:, -1:]
        ids = torch.searchsorted(cdf, uniform[:, None] * total, right=True)[:, 0]
        if bool((ids >= vocab).any()):  # u * total rounded up to the total: the last token with mass
            ids = torch.minimum(ids, (cdf < total).sum(dim=-1))
        return ids

    def verify_drafts(
        self, drafts: list[int], draft_probs: torch.Tensor, processed: torch.Tensor, rows: list[SamplingRow],
        ids: list[int], lps: list[float],
    ) -> tuple[int, list[int], list[float]]:
        """Rejection sampling (Leviathan et al., Chen et al.): draft ``d_j`` drawn from
        ``q_j`` is kept with probability ``min(1, p_j(d_j) / q_j(d_j))``; the first
        rejected position draws from ``max(0, p_j - q_j)`` normalised; when every
        draft is kept, the target's own draw at the last position (``ids[-1]``)
        follows. ``processed``: the target's processed logits at the request's
        positions, ``rows`` its sampling rows there. A seeded request's test at a
        position and its residual draw come from generators keyed by that position
        (`generator`), so they do not depend on how many drafts the step
        verified. Returns (accepted, emitted ids, their log-probabilities under p)."""
        k = len(drafts)
        logp = torch.log_softmax(processed.float(), dim=-1)
        p = logp.exp()
        q = draft_probs.to(p.device, torch.float32)
        index = torch.arange(k, device=p.device)
        draft_ids = torch.tensor(drafts, dtype=torch.int64, device=p.device)
        p_d, q_d = p[index, draft_ids], q[index, draft_ids]
        if rows[0].params.seed is not None:
            uniform = torch.cat([torch.rand(1, generator=self.generator(rows[j], p.device, stream=1),
                                            device=p.device) for j in range(k)])
        else:
            uniform = torch.rand(k, generator=self.generator(rows[0], p.device), device=p.device)
        keep = (uniform * q_d <= p_d).tolist()  # u < p/q, without dividing by a zero q
        accepted = next((j for j, kept in enumerate(keep) if not kept), k)
        if accepted == k:
            return k, list(drafts) + ids[k : k + 1], logp[index, draft_ids].tolist() + lps[k : k + 1]
        residual = (p[accepted] - q[accepted]).clamp_min_(0)
        total = residual.sum()
        if not total > 0:  # p <= q everywhere only when p == q: then nothing is rejected; guard rounding
            residual, total = p[accepted], p[accepted].sum()
        token = int(torch.multinomial(residual / total, 1,
                                      generator=self.generator(rows[accepted], p.device, stream=2)))
        emitted = list(drafts[:accepted]) + [token]
        return accepted, emitted, logp[torch.arange(accepted + 1, device=p.device),
                                       torch.tensor(emitted, device=p.device)].tolist()

    @staticmethod
    def top_logprobs(
        processed: torch.Tensor, sampling: list[SamplingRow], token_ids: list[int]
    ) -> list[PositionLogprobs | None]:
        """Rank and top-N of the sampled tokens, for the rows that ask only."""
        asking = [i for i, row in enumerate(sampling) if row.params.logprobs is not None]
        out: list[PositionLogprobs | None] = [None] * len(sampling)
        if asking:
            index = torch.tensor(asking, dtype=torch.int64, device=processed.device)
            entries = compute_position_logprobs(
                processed.index_select(0, index).float().cpu(), [token_ids[i] for i in asking],
                [sampling[i].params.logprobs for i in asking],
            )
            for i, entry in zip(asking, entries):
                out[i] = entry
        return out

    def generator(self, row: SamplingRow, device: torch.device, stream: int = 0) -> torch.Generator:
        """The generator ``row``'s draws come from: when seeded, its request's own,
        seeded for ``row``'s output position (``stream`` tells apart draws of other
        kinds made there: speculative decoding's acceptance tests use 1), else the
        shared one."""
        if row.params.seed is not None:
            return self._request_generator(row, device, stream)
        return self._shared_generator(device)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.seed)
            self._shared[device] = gen
        return gen

    def _request_generator(self, row: SamplingRow, device: torch.device, stream: int = 0) -> torch.Generator:
        gen = self._generators.get(row.request_id)
        if gen is None or gen.device != torch.device(device):
            gen = torch.Generator(device=device)
            self._generators[row.request_id] = gen
        gen.manual_seed(position_seed(row.params.seed, row.num_output_tokens, stream))
        return gen


def _check_ids(ids, vocab_size: int, what: str) -> None:
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"{what} token id {bad} is outside the vocabulary [0, {vocab_size})")


# -- selecting rows -------------------------------------------------------------------------


def _take(logits: torch.Tensor, indices: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(index tensor, rows ``indices`` of ``logits``); (None, ``logits``) when that is all of them."""
    if len(indices) == logits.shape[0]:
        return None, logits
    index = torch.tensor(indices, dtype=torch.int64, device=logits.device)
    return index, logits.index_select(0, index)


def _put(dst: torch.Tensor, index: torch.Tensor | None, src: torch.Tensor) -> None:
    if index is None:
        dst.copy_(src)
    else:
        dst.index_copy_(0, index, src)


def _on_rows(op: RowOp, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]) -> torch.Tensor:
    """Apply ``op`` to the rows ``indices`` only; the other rows stay as they are."""
    index, sub = _take(logits, indices)
    if index is None:
        return op(logits, rows)
    logits.index_copy_(0, index, op(sub, [rows[i] for i in indices]))
    return logits


def _column(values: list[float], like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One parameter per row as a ``(num_rows, 1)`` tensor. Thresholds computed in
    Python (double) are rounded to float32 once, as transformers' scalars are."""
    return torch.tensor(values, dtype=dtype, device=like.device).to(like.dtype)[:, None]


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``(len(token_lists), vocab)`` float32: how often each token occurs in each list
    (ids outside the vocabulary are not counted): one scatter-add for the batch."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.int64)
    flat = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64).clamp_(max=vocab)
    row_of = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)  # + a column for the rest
    counts.index_put_((row_of.to(device), flat.to(device)), torch.ones(1, device=device), accumulate=True)
    return counts[:, :vocab]


# -- the adjustments: (rows, vocab) logits of rows that use them -> same ------------------------


def _logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``logit[t] += logit_bias[t]`` (OpenAI; a bias of -100 in effect bans a token).
    Ids outside the logits are skipped: `Sampler.validate` refuses them on submission."""
    vocab, device = logits.shape[-1], logits.device
    pairs = [(i, t, v) for i, row in enumerate(rows) for t, v in row.params.logit_bias.items() if t < vocab]
    row_of, ids, values = zip(*pairs) if pairs else ((), (), ())
    index = (torch.tensor(row_of, dtype=torch.int64, device=device), torch.tensor(ids, dtype=torch.int64, device=device))
    return logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def _repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """transformers' ``RepetitionPenaltyLogitsProcessor`` (CTRL): for every token in the
    prompt or the output so far, a positive logit is divided by the penalty and a
    negative one multiplied by it."""
    tokens = [row.prompt_token_ids + row.output_token_ids for row in rows]
    seen = _token_counts(tokens, logits.shape[-1], logits.device) > 0
    penalty = _column([row.params.repetition_penalty for row in rows], logits)
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def _frequency_presence_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI's penalties over the output tokens (not the prompt):
    ``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``."""
    counts = _token_counts([row.output_token_ids for row in rows], logits.shape[-1], logits.device)
    frequency = _column([row.params.frequency_penalty for row in rows], logits)
    presence = _column([row.params.presence_penalty for row in rows], logits)
    return logits.sub_(frequency * counts + presence * (counts > 0))


def _bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """transformers' ``NoBadWordsLogitsProcessor``: a one-token word bans that token; a
    longer one bans its last token whenever the tokens so far (prompt then output)
    end with the rest of it. All (row, word) pairs are matched in one comparison."""
    pair_row, prefixes, lasts = [], [], []
    for i, row in enumerate(rows):
        for word in row.params.bad_words_token_ids:
            pair_row.append(i)
            prefixes.append(word[:-1])
            lasts.append(word[-1])
    device, vocab = logits.device, logits.shape[-1]
    width = max(len(prefix) for prefix in prefixes)
    is_match = torch.ones(len(prefixes), dtype=torch.bool, device=device)
    if width:
        # each row's last `width` tokens and each prefix, right-aligned; -1 pads a
        # short context (no token matches it), -2 a short prefix (matches anything)
        tails = [_tail(row, width) for row in rows]
        context = torch.tensor(tails, dtype=torch.int64, device=device)[torch.tensor(pair_row, device=device)]
        wanted = torch.tensor([[-2] * (width - len(p)) + list(p) for p in prefixes], dtype=torch.int64, device=device)
        is_match = ((context == wanted) | (wanted == -2)).all(dim=-1)
    in_vocab = torch.tensor([t < vocab for t in lasts], device=device)
    hits = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.int32, device=device)
    index = (torch.tensor(pair_row, device=device), torch.tensor(lasts, device=device).clamp_(max=vocab))
    hits.index_put_(index, (is_match & in_vocab).to(torch.int32), accumulate=True)
    return logits.masked_fill_(hits[:, :vocab] > 0, NEG_INF)


def _tail(row: SamplingRow, width: int) -> list[int]:
    """The last ``width`` tokens of prompt + output, left-padded with -1 (no copy of either list)."""
    tail = row.output_token_ids[-width:]
    if len(tail) < width:
        tail = row.prompt_token_ids[-(width - len(tail)):] + tail
    return [-1] * (width - len(tail)) + tail


def _min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """transformers' ``MinNewTokensLengthLogitsProcessor``: until ``min_tokens`` tokens
    were generated, EOS (unless ``ignore_eos``) and ``stop_token_ids`` are banned
    (the caller passes only the rows still short of it)."""
    vocab = logits.shape[-1]
    row_of, ids = [], []
    for i, row in enumerate(rows):
        banned = set(row.params.stop_token_ids)
        if not row.params.ignore_eos:
            banned.update(row.eos_token_ids)
        for token in sorted(t for t in banned if t < vocab):
            row_of.append(i)
            ids.append(token)
    if ids:
        device = logits.device
        index = (torch.tensor(row_of, device=device), torch.tensor(ids, dtype=torch.int64, device=device))
        logits.index_put_(index, torch.tensor(NEG_INF, device=device))
    return logits


# -- temperature and truncations (sampled rows only) -----------------------------------------------


def _temperature(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return logits.div_(_column([row.params.temperature for row in rows], logits))


def _top_k(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Keep the ``top_k`` largest logits of each row (ties with the k-th all kept)."""
    ks = torch.tensor([row.params.top_k for row in rows], dtype=torch.int64, device=logits.device)
    top = logits.topk(max(row.params.top_k for row in rows), dim=-1).values  # descending
    kth = top.gather(1, (ks - 1)[:, None])
    return logits.masked_fill_(logits < kth, NEG_INF)


def _top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Nucleus: keep the most likely tokens whose mass reaches ``top_p`` (at least one)."""
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= _column([1.0 - row.params.top_p for row in rows], logits, torch.float64)
    remove[:, -1] = False  # the most likely token always stays
    return logits.masked_fill_(remove.scatter(1, order, remove), NEG_INF)


def _min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = _column([row.params.min_p for row in rows], logits) * probs.amax(dim=-1, keepdim=True)
    remove = probs < threshold
    remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill_(remove, NEG_INF)


def repair_non_finite(logits: torch.Tensor) -> torch.Tensor:
    """Make every row of ``logits`` a distribution the sampler can draw from, in place.

    A processor can push a logit past float32's range (a huge bias, a penalty near 0, a
    third party's bug) and softmax of infinities is NaN, which would pick token 0 and
    report a NaN logprob. In a row that has NaN or +inf: NaN is a ban (-inf); if +inf
    remains, its tokens are the only ones left, equally likely; a row with nothing
    finite left is uniform. One max per row finds such rows: they are rare.
    """
    if logits.numel() == 0:
        return logits
    row_max = logits.amax(dim=-1)  # NaN if the row has a NaN, +inf if it has +inf, -inf if all are banned
    bad = (~torch.isfinite(row_max)).nonzero().flatten().tolist()
    for i in bad:
        row = logits[i]
        row.nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        is_top = torch.isposinf(row)
        if is_top.any():
            row.copy_(torch.where(is_top, 0.0, float("-inf")))
        elif not torch.isfinite(row).any():
            row.zero_()
    return logits
