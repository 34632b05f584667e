"""Pooling at the API (docs/embeddings.md): the `ember serve` flags of embeddings,
rerank and score, and the yes/no scoring of a reranker under a prompt template.
Standard library only: the CLI parses these before anything heavy is imported (the
routes' shared plumbing is `ember.api.routes.pooling`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SCORE_TOKENS = "yes,no"


def add_pooling_arguments(parser: argparse.ArgumentParser) -> None:
    """`ember serve`'s pooling flags (their variables: `ember.api.cli_env`)."""
    group = parser.add_argument_group("embeddings, rerank and score (docs/embeddings.md)")
    group.add_argument(
        "--pooling", choices=("auto", "last", "mean", "cls"), default=None,
        help="how /v1/embeddings pools a prompt's final hidden states: auto (default) reads the model's "
        "sentence-transformers config (1_Pooling/config.json), else last token [EMBER_POOLING]",
    )
    group.add_argument(
        "--pooling-normalize", action=argparse.BooleanOptionalAction, default=None,
        help="L2-normalise embeddings (default: as the sentence-transformers config's Normalize module says; "
        "normalised without such a config) [EMBER_POOLING_NORMALIZE]",
    )
    group.add_argument(
        "--matryoshka", action=argparse.BooleanOptionalAction, default=None,
        help="allow `dimensions` (truncated, re-normalised embeddings; default: when the model's config.json "
        "says is_matryoshka or matryoshka_dimensions) [EMBER_MATRYOSHKA]",
    )
    group.add_argument(
        "--score-template", metavar="TEXT|FILE", default=None,
        help="score /v1/rerank and /v1/score with the model's yes/no next-token logits on this prompt "
        "(a file, or the text itself, holding {query} and {document}; Qwen3-Reranker's way); without it, "
        "scores are embedding cosine similarities [EMBER_SCORE_TEMPLATE]",
    )
    group.add_argument(
        "--score-tokens", metavar="YES,NO", default=None,
        help="the two one-token answers of --score-template; score = P(yes) / (P(yes) + P(no)) "
        f"(default {DEFAULT_SCORE_TOKENS}) [EMBER_SCORE_TOKENS]",
    )


@dataclass(frozen=True)
class ScoreTemplate:
    """A reranker prompt and its yes/no token ids (`create_score_template`)."""

    template: str
    yes_token_id: int
    no_token_id: int

    def prompt(self, query: str, document: str) -> str:
        return self.template.replace("{query}", query).replace("{document}", document)


def read_template(text: str) -> str:
    """--score-template: a file's text when it names one, else the text itself."""
    path = Path(text)
    try:
        if len(text) < 4096 and path.is_file():
            return path.read_text()
    except OSError:
        pass
    return text


def create_score_template(template: str | None, tokens: str | None, encode) -> ScoreTemplate | None:
    """The server's yes/no scoring (None without --score-template); ValueError naming the
    flag for a template without both placeholders or an answer that is not one token."""
    if template is None:
        return None
    text = read_template(template)
    if "{query}" not in text or "{document}" not in text:
        raise ValueError("--score-template must hold both {query} and {document}")
    words = [w for w in (tokens or DEFAULT_SCORE_TOKENS).split(",")]
    if len(words) != 2 or not all(words):
        raise ValueError(f"--score-tokens must be two comma-separated answers such as yes,no, got {tokens!r}")
    ids = []
    for word in words:
        encoded = encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"--score-tokens: {word!r} is {len(encoded)} tokens for this tokenizer, not one")
        ids.append(encoded[0])
    return ScoreTemplate(text, ids[0], ids[1])
