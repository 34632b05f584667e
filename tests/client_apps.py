"""The client libraries people call Ember with, run against a live server by the
contract tests (tests/test_clients.py on the tiny model, tests/test_clients_smollm2.py
on SmolLM2): LangChain's ChatOpenAI, LiteLLM and the Vercel AI SDK (JavaScript, run with
the machine's node; its npm packages are installed once, pinned, into a cache folder).

Each function calls one client the way its documentation shows and returns plain values
for the tests to check, so the same checks run on both models."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM reads its model map from GitHub otherwise

# The Vercel AI SDK, pinned: ai 6 is the newest major that runs on Node 18/20 (ai 7 needs Node 22).
NPM_PACKAGES = ("ai@6.0.333", "@ai-sdk/openai-compatible@2.0.92", "zod@4.6.7")
AI_SDK_SCRIPT = Path(__file__).parent / "clients" / "ai_sdk.mjs"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}


def ai_sdk_dir() -> Path:
    """A folder holding the pinned npm packages (installed on first use); skipped where
    node or npm is missing, a failure in CI (CI set), where every client must run."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        if os.environ.get("CI"):
            pytest.fail("node and npm are needed for the Vercel AI SDK contract test")
        pytest.skip("node/npm not installed")
    key = hashlib.sha256(" ".join(NPM_PACKAGES).encode()).hexdigest()[:12]
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ember-tests" / f"ai-sdk-{key}"
    if not (folder / "node_modules" / "ai" / "package.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "package.json").write_text(json.dumps({"private": True, "type": "module"}))
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--save-exact", "--loglevel=error", *NPM_PACKAGES],
                       cwd=folder, check=True, timeout=600, capture_output=True)
    shutil.copy(AI_SDK_SCRIPT, folder / AI_SDK_SCRIPT.name)  # node resolves packages from the script's folder
    return folder


def run_ai_sdk(folder: Path, url: str, model: str, api_key: str = "none") -> dict[str, Any]:
    done = subprocess.run(["node", AI_SDK_SCRIPT.name], cwd=folder, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "EMBER_URL": url, "EMBER_MODEL": model, "EMBER_API_KEY": api_key})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def langchain_calls(url: str, model: str, api_key: str = "none") -> dict[str, Any]:
    """ChatOpenAI: invoke, stream, bind_tools with a named tool, with_structured_output, the
    Responses API (``use_responses_api=True``); OpenAIEmbeddings."""
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)
        population: int = Field(ge=0, le=99_999_999)

    llm = ChatOpenAI(base_url=f"{url}/v1", api_key=api_key, model=model, temperature=0, max_tokens=12, max_retries=0)
    invoked = llm.invoke("Name a colour.")
    streamed = list(llm.stream("Name a colour."))
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": WEATHER}}
    longer = ChatOpenAI(base_url=f"{url}/v1", api_key=api_key, model=model, temperature=0, max_tokens=120, max_retries=0)
    called = longer.bind_tools([tool], tool_choice="get_weather").invoke("Weather in Paris?")
    structured = longer.with_structured_output(City, method="json_schema").invoke("A city.")
    responses = ChatOpenAI(base_url=f"{url}/v1", api_key=api_key, model=model, temperature=0, max_tokens=12,
                           max_retries=0, use_responses_api=True)
    embedder = OpenAIEmbeddings(base_url=f"{url}/v1", api_key=api_key, model=model, check_embedding_ctx_length=False,
                                max_retries=0)
    return {
        "invoke": invoked.content, "finish_reason": invoked.response_metadata.get("finish_reason"),
        "usage": invoked.usage_metadata, "stream": "".join(chunk.content for chunk in streamed),
        "tool_calls": called.tool_calls, "structured": structured,
        "responses": responses.invoke("Name a colour.").text,
        "responses_stream": "".join(chunk.text for chunk in responses.stream("Name a colour.")),
        "documents": embedder.embed_documents(["sunny weather", "a bright sunny day", "tax law"]),
        "query": embedder.embed_query("sunny weather"),
    }


def litellm_calls(url: str, model: str, api_key: str = "none") -> dict[str, Any]:
    """LiteLLM's completion() with Ember as an OpenAI-compatible provider (``openai/NAME``
    and ``api_base``): plain, streamed, and a forced tool call; embedding()."""
    import litellm

    common = dict(model=f"openai/{model}", api_base=f"{url}/v1", api_key=api_key, temperature=0, num_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    plain = litellm.completion(messages=messages, max_tokens=12, **common)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       litellm.completion(messages=messages, max_tokens=12, stream=True, **common))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    called = litellm.completion(messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=120,
                                tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                **common)
    embedded = litellm.embedding(model=f"openai/{model}", api_base=f"{url}/v1", api_key=api_key,
                                 input=["sunny weather", "tax law"])
    return {"text": plain.choices[0].message.content, "finish_reason": plain.choices[0].finish_reason,
            "usage": plain.usage, "stream": streamed, "tool_calls": called.choices[0].message.tool_calls,
            "tool_finish_reason": called.choices[0].finish_reason,
            "embeddings": [item["embedding"] for item in embedded.data]}
