"""The client contract tests of tests/test_clients.py on the real default model, SmolLM2
(LangChain's ChatOpenAI, LiteLLM, the Vercel AI SDK): the same checks, against a real
`ember serve` with an API key."""

from __future__ import annotations

import pytest
from client_apps import ai_sdk_dir, langchain_calls, litellm_calls, run_ai_sdk
from server_utils import running_server
from test_clients import check_ai_sdk, check_langchain, check_litellm

pytestmark = pytest.mark.slow
KEY = "sekrit"


@pytest.fixture(scope="module")
def server(smollm2_dir):
    with running_server(smollm2_dir, engine={"num_kv_blocks": 256, "block_size": 16}, max_total_tokens=2048,
                        served_model_name="smollm2", api_key=KEY) as running:
        yield running


def test_langchain_chat_openai(server):
    check_langchain(langchain_calls(server.url, "smollm2", KEY))


def test_litellm_completion(server):
    check_litellm(litellm_calls(server.url, "smollm2", KEY))


def test_vercel_ai_sdk(server):
    check_ai_sdk(run_ai_sdk(ai_sdk_dir(), server.url, "smollm2", KEY))
