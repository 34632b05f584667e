"""What `ember bench` sends: random prompts, a synthetic chat set, or a user's JSONL file.

Every dataset yields `BenchRequest`s in a fixed order for a given seed, so that two
runs (two servers, or a server and the offline engine) send the same requests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("random", "chat", "jsonl")

# The chat set of benchmarks/bench_offline.py: 16 topics x 4 styles, from one sentence
# to a paragraph, so that `ember bench offline --dataset chat` runs the same workload.
TOPICS = (
    "the water cycle", "how a CPU cache works", "the history of the printing press",
    "why the sky is blue", "photosynthesis", "the rules of chess", "black holes",
    "how vaccines work", "the French revolution", "compound interest", "plate tectonics",
    "the TCP handshake", "how bread rises", "the life of bees", "jazz improvisation",
    "the Pythagorean theorem",
)
STYLES = (
    "Explain {t} in one sentence.",
    "Write a short paragraph about {t} for a ten-year-old.",
    "I am preparing a lecture. Give me an outline covering {t}, with three main points, "
    "each with a short example, and a closing summary that ties them together.",
    "My friend and I disagree about {t}. She says it is simple, I say it has many subtle "
    "parts. Could you walk through the main ideas step by step, note the common "
    "misconceptions, and then tell us which of us is closer to the truth and why? "
    "Please be thorough but keep the language plain.",
)

# Random prompts without a tokenizer are drawn from these words (most are one token in
# common BPE vocabularies, so a prompt of N words is roughly N to 1.3 N tokens).
WORDS = tuple(
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect use class control care field development role effort rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship "
    "town road arm difference value building action model season society tax director "
    "position player record paper space ground form event official matter center couple "
    "site project activity star table need court oil situation cost industry figure street "
    "image phone data picture practice piece land product doctor wall patient worker news".split()
)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a benchmark: a plain prompt or chat messages, and its output length.

    `prompt_token_ids` is set when the prompt was built from token ids (the random
    dataset with a tokenizer); the offline engine then takes them as they are.
    """

    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a bench request needs exactly one of prompt and messages")

    def as_prompt(self) -> str:
        """The text for /v1/completions (chat messages joined, no template)."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages)

    def as_messages(self) -> list[dict[str, str]]:
        """The messages for /v1/chat/completions (a plain prompt is one user message)."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]


@dataclass(frozen=True)
class DatasetSpec:
    """Which dataset and its sizes, as given on the command line."""

    name: str = "chat"
    num_prompts: int | None = None  # None: 64 (jsonl: every line of the file)
    max_tokens: int = 128  # chat, and jsonl lines without max_tokens
    input_len: int = 128  # random: prompt length (tokens with a tokenizer, else words)
    output_len: int = 128  # random: max_tokens
    range_ratio: float = 0.0  # random: lengths uniform in [len * (1 - r), len * (1 + r)]
    path: str | None = None  # jsonl
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}: choose one of {', '.join(DATASETS)}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        for flag, value in (("--max-tokens", self.max_tokens), ("--random-input-len", self.input_len),
                            ("--random-output-len", self.output_len)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.name == "jsonl" and not self.path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")


DEFAULT_NUM_PROMPTS = 64


def create_requests(spec: DatasetSpec, tokenizer: Any | None = None) -> list[BenchRequest]:
    """The requests of `spec`. `tokenizer` (a Hugging Face tokenizer) makes random
    prompts out of token ids; without it they are random words."""
    if spec.name == "chat":
        return chat_requests(spec.num_prompts or DEFAULT_NUM_PROMPTS, spec.max_tokens)
    if spec.name == "random":
        return random_requests(spec, tokenizer)
    return jsonl_requests(Path(spec.path), spec.num_prompts, spec.max_tokens)


def chat_requests(num_prompts: int, max_tokens: int) -> list[BenchRequest]:
    """The synthetic chat set: 64 distinct one-message conversations, repeated in order."""
    requests = []
    for i in range(num_prompts):
        text = STYLES[i % len(STYLES)].format(t=TOPICS[(i // len(STYLES)) % len(TOPICS)])
        requests.append(BenchRequest(max_tokens, messages=({"role": "user", "content": text},)))
    return requests


def _lengths(rng: random.Random, length: int, ratio: float) -> int:
    low, high = max(1, round(length * (1 - ratio))), max(1, round(length * (1 + ratio)))
    return rng.randint(low, high)


def random_requests(spec: DatasetSpec, tokenizer: Any | None = None) -> list[BenchRequest]:
    """Prompts of random tokens (or words) with lengths uniform in the range, and
    `max_tokens` likewise; seeded by `spec.seed`."""
    rng = random.Random(spec.seed)
    num_prompts = spec.num_prompts or DEFAULT_NUM_PROMPTS
    vocab = _plain_token_ids(tokenizer) if tokenizer is not None else None
    requests = []
    for _ in range(num_prompts):
        num_input = _lengths(rng, spec.input_len, spec.range_ratio)
        num_output = _lengths(rng, spec.output_len, spec.range_ratio)
        if vocab is None:
            requests.append(BenchRequest(num_output, prompt=" ".join(rng.choice(WORDS) for _ in range(num_input))))
            continue
        ids = tuple(rng.choice(vocab) for _ in range(num_input))
        requests.append(BenchRequest(num_output, prompt=tokenizer.decode(list(ids)), prompt_token_ids=ids))
    return requests


def _plain_token_ids(tokenizer: Any) -> list[int]:
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    if not ids:
        raise ValueError("the tokenizer has no ordinary tokens to draw random prompts from")
    return ids


def jsonl_requests(path: Path, num_prompts: int | None, default_max_tokens: int) -> list[BenchRequest]:
    """One request per non-blank line: ``{"prompt": str}`` or ``{"messages": [{"role",
    "content"}, ...]}``, with an optional ``"max_tokens": int``. With `num_prompts`
    the lines are taken in order, repeated if the file holds fewer."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ValueError(f"--dataset-path {str(path)!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--dataset-path {str(path)!r} could not be read: {exc}") from None
    requests = [
        _jsonl_request(line, f"{path}:{number}", default_max_tokens)
        for number, line in enumerate(lines, 1)
        if line.strip()
    ]
    if not requests:
        raise ValueError(f"--dataset-path {str(path)!r} holds no requests (one JSON object per line)")
    if num_prompts is None:
        return requests
    return [requests[i % len(requests)] for i in range(num_prompts)]


def _jsonl_request(line: str, where: str, default_max_tokens: int) -> BenchRequest:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg}): {line[:80]!r}") from None
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(item).__name__}")
    unknown = sorted(set(item) - {"prompt", "messages", "max_tokens"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)} (expected prompt or messages, max_tokens)")
    max_tokens = item.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    if ("prompt" in item) == ("messages" in item):
        raise ValueError(f"{where}: give exactly one of prompt and messages")
    if "prompt" in item:
        prompt = item["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: prompt must be a non-empty string, got {prompt!r:.80}")
        return BenchRequest(max_tokens, prompt=prompt)
    return BenchRequest(max_tokens, messages=_messages(item["messages"], where))


def _messages(value: object, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: messages must be a non-empty list, got {value!r:.80}")
    messages = []
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(f"{where}: messages[{i}] must be {{\"role\": str, \"content\": str}}, got {message!r:.80}")
        messages.append({"role": message["role"], "content": message["content"]})
    return tuple(messages)


def count_tokens(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Token counts of `texts` (no special tokens added)."""
    return [len(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
