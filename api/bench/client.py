"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

The body asks for ``stream_options: {"include_usage": true}``; when the server sends
a last chunk with `usage`, its `completion_tokens` is the output length. Otherwise
the output is counted with the tokenizer given (``--tokenizer``), else as one token
per text-carrying chunk (exact for servers that send one chunk per token, as Ember,
vLLM and TGI do without speculation).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ember.api.bench.datasets import BenchRequest
from ember.api.bench.metrics import RequestRecord

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MAX_ERROR_CHARS = 300


def normalize_base_url(url: str) -> str:
    """``http://host:port`` from what the user gave (a trailing ``/`` or ``/v1`` is dropped)."""
    parsed = httpx.URL(url) if "://" in url else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--base-url {url!r} is not an http(s) URL such as http://127.0.0.1:3000")
    text = url.rstrip("/")
    return text[: -len("/v1")] if text.endswith("/v1") else text


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "chat"
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}: choose one of {', '.join(ENDPOINTS)}")

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = request.as_messages()
        else:
            body["prompt"] = request.as_prompt()
        if self.ignore_eos:
            body["ignore_eos"] = True  # an extension Ember, vLLM and llama.cpp's server honour
        body.update(self.extra_body)
        return body


async def fetch_model_name(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    """The first model id of ``GET /v1/models``."""
    url = base_url + "/v1/models"
    try:
        response = await client.get(url, headers=headers)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"could not read the model name from {url} ({_describe(exc)}); pass --model NAME") from None


async def send_request(client: httpx.AsyncClient, config: ClientConfig, request: BenchRequest,
                       record: RequestRecord, run_start: float, tokenizer: Any | None = None) -> None:
    """Send `request`, stream its answer, and fill `record` (never raises for a failed
    request: the failure goes to `record.error`)."""
    start = time.perf_counter()
    record.start_s = start - run_start
    texts: list[str] = []
    usage: dict | None = None
    is_done = has_finish_reason = False
    try:
        async with client.stream("POST", config.url, json=config.body(request), headers=config.headers) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {_error_message(response.text)}"
                return
            event = "message"
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line[len("event:"):].strip()
                    continue
                if not line.startswith("data:"):
                    if not line:
                        event = "message"
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    is_done = True
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    record.error = f"the server sent a chunk that is not JSON: {data[:80]!r}"
                    return
                if event == "error" or (isinstance(chunk, dict) and "error" in chunk):
                    record.error = f"error in stream: {_error_message(data)}"
                    return
                if not isinstance(chunk, dict):
                    continue
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    text = _choice_text(choice)
                    if text:
                        record.chunk_times_s.append(time.perf_counter() - start)
                        texts.append(text)
                    if choice.get("finish_reason"):
                        has_finish_reason = True
    except httpx.HTTPError as exc:
        record.error = _describe(exc)
        return
    finally:
        record.e2el_s = time.perf_counter() - start
    if not (is_done or has_finish_reason):
        record.error = "the stream ended before a finish_reason or [DONE]"
        return
    record.ttft_s = record.chunk_times_s[0] if record.chunk_times_s else None
    _count_tokens(record, config, request, texts, usage, tokenizer)


def _count_tokens(record: RequestRecord, config: ClientConfig, request: BenchRequest, texts: list[str],
                  usage: dict | None, tokenizer: Any | None) -> None:
    if usage and isinstance(usage.get("completion_tokens"), int):
        record.num_output_tokens = usage["completion_tokens"]
        record.output_tokens_source = "usage"
    elif tokenizer is not None:
        record.num_output_tokens = len(tokenizer.encode("".join(texts), add_special_tokens=False))
        record.output_tokens_source = "tokenizer"
    else:
        record.num_output_tokens = len(texts)
        record.output_tokens_source = "chunks"
    if usage and isinstance(usage.get("prompt_tokens"), int):
        record.num_input_tokens = usage["prompt_tokens"]
    elif request.prompt_token_ids is not None and config.endpoint == "completions":
        record.num_input_tokens = len(request.prompt_token_ids)
    elif tokenizer is not None:
        record.num_input_tokens = len(tokenizer.encode(request.as_prompt(), add_special_tokens=False))


def _choice_text(choice: dict) -> str:
    if "delta" in choice:  # chat
        delta = choice["delta"] or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _error_message(text: str) -> str:
    """The message of an OpenAI (``{"error": {"message"}}``) or TGI (``{"error": str}``) error body."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:MAX_ERROR_CHARS] or "(empty body)"
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error)[:MAX_ERROR_CHARS]


def _describe(exc: BaseException) -> str:
    message = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {message}"[:MAX_ERROR_CHARS]
