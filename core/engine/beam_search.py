"""Beam search for the offline API (`LLM.beam_search`), as vLLM's offline beam search:
each step asks the engine for the top ``2 * beam_width`` next tokens of every live
beam (requests of one token with logprobs), keeps the ``beam_width`` best
continuations by cumulative logprob, and retires beams that end in EOS. The beams
of a prompt share their prefix's KV blocks through the prefix cache, so a step
computes about one block per beam, not the whole sequence.

Scores follow transformers: a finished hypothesis scores
``cumulative_logprob / generated_length ** length_penalty``; at ``max_tokens`` the
live beams are finished too. Search stops early once ``beam_width`` hypotheses are
finished and no live beam can still beat the worst of them (transformers'
``early_stopping=True``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.sampling_params import SamplingParams

MAX_BEAM_WIDTH = 10  # 2 * beam_width alternatives per step must fit the logprobs limit (20)


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass
class BeamSequence:
    token_ids: list[int]
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    text: str = ""
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)  # best first


def _score(seq: BeamSequence, length_penalty: float) -> float:
    return seq.cumulative_logprob / (max(1, len(seq.token_ids)) ** length_penalty)


def beam_search(engine, prompts: list[tuple[str | None, list[int]]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for every prompt at once; `engine` is an idle `LLMEngine`."""
    width = params.beam_width
    eos = set() if params.ignore_eos else set(engine.eos_token_ids)
    step_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2 * width)
    live = [[BeamSequence([])] for _ in prompts]
    finished: list[list[BeamSequence]] = [[] for _ in prompts]
    for step in range(params.max_tokens):
        requests = {}
        for p, beams in enumerate(live):
            for b, beam in enumerate(beams):
                rid = engine.add_request(None, step_params, prompt_token_ids=prompts[p][1] + beam.token_ids)
                requests[rid] = (p, b)
        top: dict[tuple[int, int], dict] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in requests:
                    top[requests[out.request_id]] = out.outputs[0].logprobs[0]
        for p, beams in enumerate(live):
            candidates = sorted(
                (
                    (beam.cumulative_logprob + lp.logprob, b, token_id)
                    for b, beam in enumerate(beams)
                    for token_id, lp in top[(p, b)].items()
                ),
                key=lambda c: -c[0],
            )
            next_beams: list[BeamSequence] = []
            for rank, (cum, b, token_id) in enumerate(candidates):
                seq = BeamSequence(beams[b].token_ids + [token_id], cum)
                if token_id in eos:
                    if rank < width:  # as transformers: only EOS among the top beam_width counts
                        seq.finish_reason = "stop"
                        seq.score = _score(seq, params.length_penalty)
                        finished[p].append(seq)
                    continue
                next_beams.append(seq)
                if len(next_beams) == width:
                    break
            live[p] = next_beams
            finished[p] = sorted(finished[p], key=lambda s: -s.score)[:width]
            if len(finished[p]) == width and live[p]:
                best_possible = max(_score(s, params.length_penalty) for s in live[p])
                if best_possible <= finished[p][-1].score:
                    live[p] = []
        if not any(live):
            break
    outputs = []
    for p, (prompt, ids) in enumerate(prompts):
        for seq in live[p]:
            seq.finish_reason = "length"
            seq.score = _score(seq, params.length_penalty)
        ranked = sorted(finished[p] + live[p], key=lambda s: -s.score)[:width]
        for seq in ranked:
            seq.text = engine.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        outputs.append(BeamSearchOutput(prompt, ids, ranked))
    return outputs
