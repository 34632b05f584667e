"""The web playground (issue 34, docs/playground.md) on a real server (tiny random Llama):
its files over plain HTTP (content types, cache headers, ETags, no API key, package
data in the wheel), then the page in a real headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by Selenium): a streamed answer, JSON-schema mode, a tool
round trip, logprobs on hover, a refused request's error, "copy as curl / Python" run
for real, the API-key prompt with a LoRA adapter in the model picker, the page
under a path prefix (--root-path, and Ember mounted in a parent app), and images (a
tiny random LLaVA): attached by the file picker, pasted and dropped, sent as image_url
parts and answered as the HTTP API answers them, and a text-only model's refusal. Chromium missing:
skipped here, a failure under CI=1. ``EMBER_PLAYGROUND_SCREENSHOT=PATH`` saves the
docs' screenshot (docs/img/playground.png) from the same setup.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import jsonschema
import pytest
from server_utils import running_server, wait_idle
from starlette.applications import Starlette
from starlette.routing import Mount
from tiny_models import with_context

from ember.api.routes.playground import ASSETS, load_assets
from ember.api.settings import ServerSettings

KEY = "playground-Key_0123"
MAX_TOTAL_TOKENS = 1536  # a tool declaration is ~700 tokens of the byte-level tokenizer
REPO = Path(__file__).resolve().parent.parent
CHROME_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1280,860",
)
WAIT_S = 30
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
                   "famous_for": {"type": "string", "maxLength": 40}},
    "required": ["city", "country", "famous_for"],
    "additionalProperties": False,
}


def _skip_or_fail(reason: str) -> None:
    """As tests/conftest.py's: the browser tests must not silently vanish from CI."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


# -- servers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_llama_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with room for tool prompts (its random weights do not mind)."""
    path = with_context(tiny_llama_dir, tmp_path_factory.mktemp("tiny-long") / "model", MAX_TOTAL_TOKENS)
    return path


@pytest.fixture(scope="module")
def server(long_llama_dir):
    with running_server(long_llama_dir, engine={"num_kv_blocks": 512}, max_total_tokens=MAX_TOTAL_TOKENS,
                        served_model_name="tiny") as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


# -- the files over HTTP -----------------------------------------------------------------------
def test_page_is_served_without_a_key_and_revalidated(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=64, api_key=KEY) as (url, _):
        for path in ("/", "/ui"):
            check_page(url, path)
        # the page is open; the API behind it is not (POST / is TGI's generate route)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.post(url + "/", json={"inputs": "hi"}).status_code == 401
        assert httpx.post(url + "/ui/app.js", json={}).status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def check_page(url: str, path: str) -> None:
    r = httpx.get(url + path)
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.headers["cache-control"] == "no-cache" and r.headers["etag"].startswith('"')
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    assert '<base href="/">' in r.text
    for name in ASSETS:  # referred to by content hash
        assert f'"ui/{name}?v=' in r.text
    again = httpx.get(url + path, headers={"If-None-Match": r.headers["etag"]})
    assert again.status_code == 304 and again.content == b""


@pytest.mark.parametrize("name", sorted(ASSETS))
def test_assets_have_their_types_and_are_cached(http, name):
    r = http.get(f"/ui/{name}")
    assert r.status_code == 200 and r.headers["content-type"] == ASSETS[name]
    assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert r.headers["x-content-type-options"] == "nosniff"
    page = http.get("/").text
    assert f'"ui/{name}?v={r.headers["etag"].strip(chr(34))}"' in page
    assert http.get(f"/ui/{name}", headers={"If-None-Match": r.headers["etag"]}).status_code == 304
    assert http.head(f"/ui/{name}").status_code == 200


def test_unknown_asset_is_404_and_nothing_is_fetched_from_elsewhere(http):
    r = http.get("/ui/secret.py")
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"
    assert http.get("/ui/..%2Fserver.py").status_code == 404
    page, assets = load_assets()
    for text in [page] + [asset.body.decode() for asset in assets.values()]:
        assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text  # no CDN


def test_openapi_documents_the_playground(http):
    paths = http.get("/openapi.json").json()["paths"]
    for path, media_type in [("/", "text/html"), ("/ui", "text/html"), ("/ui/app.js", "text/javascript"),
                             ("/ui/style.css", "text/css")]:
        assert list(paths[path]["get"]["responses"]["200"]["content"]) == [media_type]


def test_package_data_ships_the_files():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["ember.api"]
    shipped = {path.name for pattern in config for path in (REPO / "api").glob(pattern)}
    assert shipped == {"index.html", *ASSETS}


@pytest.mark.parametrize("root_path", ["ember", "/ember/", "/a b", "/x?y=1"])
def test_root_path_must_be_a_path(root_path):
    with pytest.raises(ValueError, match="--root-path must be a URL path"):
        ServerSettings(root_path=root_path)


def test_root_path_flag_and_variable(monkeypatch):
    from ember.api.cli import build_parser
    from ember.api.cli_env import apply_defaults

    parser = build_parser()
    args = parser.parse_args(["serve", "--root-path", "/ember"])
    apply_defaults(args, {})
    assert args.root_path == "/ember"
    args = parser.parse_args(["serve"])
    apply_defaults(args, {"EMBER_ROOT_PATH": "/proxy/llm"})
    assert args.root_path == "/proxy/llm"


# -- the page in Chromium -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        _skip_or_fail("Debian's chromium and chromium-driver are not installed "
                      "(apt-get install chromium chromium-driver)")
    if importlib.util.find_spec("selenium") is None:
        _skip_or_fail("selenium is not installed (it is in the test extras)")
    driver = create_browser(tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield driver
    finally:
        driver.quit()


def create_browser(profile_dir: Path):
    """Debian's headless Chromium under Selenium, with the flags this closed network needs
    (without the background-networking ones its connections are refused) and a fresh profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile_dir}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=shutil.which("chromedriver")))
    driver.set_script_timeout(WAIT_S)
    return driver


def wait_for(driver, condition, message: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda d: condition(d), message)


def by_css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def open_page(driver, url: str, expect_models: bool = True) -> None:
    driver.get(url)
    if expect_models:
        wait_for(driver, lambda d: by_css(d, "#model option"), "the model picker stayed empty")


def set_field(driver, element_id: str, value) -> None:
    """A form field's value as a user's typing would leave it (an input event fires)."""
    driver.execute_script(
        "const e = document.getElementById(arguments[0]);"
        "if (e.type === 'checkbox') e.checked = arguments[1]; else e.value = arguments[1];"
        "e.dispatchEvent(new Event(e.tagName === 'SELECT' || e.type === 'checkbox' ? 'change' : 'input'));",
        element_id, value,
    )


def send(driver, text: str) -> None:
    by_css(driver, "#prompt")[0].send_keys(text)
    by_css(driver, "#send")[0].click()


def last_turn(driver):
    """The last assistant message once finished (or the error shown instead)."""
    def finished(d):
        errors = by_css(d, ".msg.error")
        turns = by_css(d, ".msg.assistant")
        if errors:
            return errors[-1]
        if turns and turns[-1].get_attribute("data-state") in ("done", "error"):
            return turns[-1]
        return False
    return wait_for(driver, finished, "no answer finished")


def count_text_changes(driver) -> None:
    """Record each distinct text of the streaming message, as the DOM changes."""
    driver.execute_script("""
        window.seenTexts = [];
        new MutationObserver(() => {
          const turns = document.querySelectorAll('.msg.assistant');
          const turn = turns[turns.length - 1];
          if (!turn || turn.dataset.state !== 'streaming') return;
          const text = turn.querySelector('.content').textContent;
          if (window.seenTexts[window.seenTexts.length - 1] !== text) window.seenTexts.push(text);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    """)


def test_streamed_answer_matches_the_api(server, http, browser):
    open_page(browser, server.url + "/")
    assert [o.get_attribute("value") for o in by_css(browser, "#model option")] == ["tiny"]
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "24")
    set_field(browser, "system", "Be brief.")
    count_text_changes(browser)
    send(browser, "hello there")
    turn = last_turn(browser)
    assert "error" not in turn.get_attribute("class"), turn.text
    shown = turn.find_element("css selector", ".content").text
    seen = browser.execute_script("return window.seenTexts")
    assert len(seen) >= 5 and all(len(a) < len(b) for a, b in zip(seen, seen[1:])), seen  # arrived piece by piece
    reference = http.post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
    }).json()["choices"][0]["message"]["content"]
    assert shown.strip() == reference.strip()
    assert by_css(browser, "#stat-tokens")[0].text == "24"
    assert by_css(browser, "#stat-ttft")[0].text.endswith(" ms")
    assert float(by_css(browser, "#stat-tps")[0].text) > 0
    wait_for(browser, lambda d: by_css(d, "#stat-kv")[0].text.endswith("%"), "no KV-cache use from /metrics")
    # the conversation goes on with its history
    send(browser, "and more")
    last_turn(browser)
    history = browser.execute_script("return state.lastRequest.messages.map(m => m.role)")
    assert history == ["system", "user", "assistant", "user"]


def generated_tokens(http) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    return sum(sample.value for sample in families["ember_generation_tokens"].samples
               if sample.name == "ember_generation_tokens_total")


def test_stop_aborts_the_generation(server, http, browser):
    open_page(browser, server.url + "/")
    before = generated_tokens(http)
    set_field(browser, "max_tokens", "1200")
    send(browser, "go on for a while")
    wait_for(browser, lambda d: int(by_css(d, ".msg.assistant")[-1].get_attribute("data-updates")) >= 3,
             "no tokens arrived")
    by_css(browser, "#stop-generation")[0].click()
    turn = last_turn(browser)
    assert turn.get_attribute("data-finish-reason") == "stopped"
    assert int(by_css(browser, "#stat-tokens")[0].text) < 1200
    wait_idle(server.app)  # the server saw the client leave and aborted the request
    assert server.app.state.service.num_in_flight == 0
    assert generated_tokens(http) - before < 1200
    assert by_css(browser, "#send")[0].is_enabled()


def test_json_schema_mode_shows_valid_json(server, browser):
    open_page(browser, server.url + "/ui")
    set_field(browser, "mode", "json")
    set_field(browser, "max_tokens", "120")
    schema = json.loads(by_css(browser, "#schema")[0].get_attribute("value"))
    send(browser, "a person please")
    turn = last_turn(browser)
    assert "error" not in turn.get_attribute("class"), turn.text
    assert turn.find_element("css selector", ".json-ok").text == "valid JSON"
    shown = json.loads(turn.find_element("css selector", "pre.json").text)
    jsonschema.validate(shown, schema)
    sent = browser.execute_script("return state.lastRequest.response_format")
    assert sent["type"] == "json_schema" and sent["json_schema"]["schema"] == schema


def test_tool_round_trip(server, browser):
    open_page(browser, server.url + "/")
    set_field(browser, "mode", "tools")
    set_field(browser, "tool_choice", "function:get_weather")
    set_field(browser, "max_tokens", "80")
    tools = json.loads(by_css(browser, "#tools")[0].get_attribute("value"))
    send(browser, "what is the weather in Paris?")
    turn = last_turn(browser)
    assert turn.get_attribute("data-finish-reason") == "tool_calls", turn.text
    card = turn.find_element("css selector", ".tool-call")
    assert card.find_element("css selector", ".tool-name").text == "call get_weather"
    arguments = json.loads(card.find_element("css selector", ".tool-args").text)
    jsonschema.validate(arguments, tools[0]["function"]["parameters"])
    card.find_element("css selector", ".tool-result").send_keys('{"temperature": 21}')
    turn.find_element("css selector", ".tool-send").click()
    wait_for(browser, lambda d: len(by_css(d, ".msg.assistant")) == 2, "no answer after the tool result")
    answer = last_turn(browser)
    assert "error" not in answer.get_attribute("class"), answer.text
    messages = browser.execute_script("return state.lastRequest.messages")
    call_id = messages[1]["tool_calls"][0]["id"]
    assert card.get_attribute("data-call-id") == call_id
    assert messages[2] == {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'}


def test_logprobs_on_hover(server, browser):
    from selenium.webdriver.common.action_chains import ActionChains

    open_page(browser, server.url + "/")
    set_field(browser, "logprobs", True)
    set_field(browser, "top_logprobs", "3")
    set_field(browser, "max_tokens", "12")
    send(browser, "hi")
    turn = last_turn(browser)
    tokens = turn.find_elements("css selector", ".tok")
    assert len(tokens) == 12
    ActionChains(browser).move_to_element(tokens[3]).perform()
    tooltip = wait_for(browser, lambda d: by_css(d, "#tooltip")[0].is_displayed() and by_css(d, "#tooltip")[0],
                       "no tooltip on hover")
    rows = tooltip.find_elements("css selector", "tr")
    assert len(rows) == 1 + 3  # the chosen token, then the top 3
    chosen = browser.execute_script("return arguments[0].tokenLogprobs", tokens[3])
    assert rows[0].find_elements("css selector", "td")[0].text == json.dumps(chosen["token"], ensure_ascii=False)
    assert [float(r.find_elements("css selector", "td")[1].text) for r in rows[1:]] == pytest.approx(
        [t["logprob"] for t in chosen["top_logprobs"]], abs=1e-3)


def test_refused_request_shows_the_servers_error(server, browser):
    open_page(browser, server.url + "/")
    set_field(browser, "max_tokens", str(MAX_TOTAL_TOKENS * 4))
    send(browser, "hello")
    error = last_turn(browser)
    assert "error" in error.get_attribute("class")
    assert error.text.startswith("ERROR\nHTTP 422: ") and "max_tokens" in error.text
    assert not by_css(browser, ".msg.assistant")  # no empty answer left behind
    set_field(browser, "mode", "json")
    set_field(browser, "schema", "{not json")
    send(browser, "again")
    wait_for(browser, lambda d: len(by_css(d, ".msg.error")) == 2, "a schema that is not JSON was not reported")
    assert "JSON schema: not JSON" in by_css(browser, ".msg.error")[-1].text


def test_copy_as_curl_and_python_run(server, browser, tmp_path):
    open_page(browser, server.url + "/")
    set_field(browser, "max_tokens", "8")
    set_field(browser, "stop", "zzz")
    by_css(browser, "#prompt")[0].send_keys("say hi")
    for button, command in (("#copy-curl", ["bash"]), ("#copy-python", [sys.executable])):
        by_css(browser, button)[0].click()
        code = wait_for(browser, lambda d: by_css(d, "#code-text")[0].text, "no snippet shown")
        script = tmp_path / "snippet"
        script.write_text(code + "\n")
        result = subprocess.run([*command, str(script)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        if button == "#copy-curl":
            events = [line[6:] for line in result.stdout.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 8
        else:
            assert result.stdout.strip()
        by_css(browser, "#code-close")[0].click()
    request = browser.execute_script("return buildRequest([{role: 'user', content: 'say hi'}])")
    assert request["stop"] == ["zzz"] and request["max_tokens"] == 8 and request["stream"] is True


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory):
    """A random peft LoRA adapter for the tiny model (as tests/test_api_lora.py makes them)."""
    import peft
    import torch
    import transformers

    path = tmp_path_factory.mktemp("playground-lora") / "sql"
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(base, config).save_pretrained(path)
    return path


def test_api_key_prompt_and_adapter_picker(tiny_llama_dir, adapter_dir, browser):
    from ember.api.lora import LoRAModule

    engine = {"enable_lora": True, "lora_modules": {"sql": str(adapter_dir)}, "max_lora_rank": 16}
    with running_server(tiny_llama_dir, engine=engine, max_total_tokens=128, served_model_name="tiny", api_key=KEY,
                        lora_modules=(LoRAModule("sql", str(adapter_dir)),)) as (url, _):
        open_page(browser, url + "/", expect_models=False)
        dialog = wait_for(browser, lambda d: by_css(d, "#key-dialog[open]") and by_css(d, "#key-dialog")[0],
                          "the 401 did not ask for the key")
        assert "needs an API key" in dialog.text
        by_css(browser, "#key-input")[0].send_keys("wrong-key")
        by_css(browser, "#key-save")[0].click()
        wait_for(browser, lambda d: "was refused" in by_css(d, "#key-message")[0].text, "a wrong key was not refused")
        by_css(browser, "#key-input")[0].send_keys(KEY)
        by_css(browser, "#key-save")[0].click()
        wait_for(browser, lambda d: len(by_css(d, "#model option")) == 2, "the models did not load with the key")
        options = {o.get_attribute("value"): o.text for o in by_css(browser, "#model option")}
        assert options == {"tiny": "tiny", "sql": "sql (adapter of tiny)"}
        assert browser.execute_script("return sessionStorage.getItem('ember-api-key')") == KEY
        set_field(browser, "model", "sql")
        set_field(browser, "max_tokens", "6")
        send(browser, "hello")
        turn = last_turn(browser)
        assert turn.get_attribute("data-state") == "done" and "error" not in turn.get_attribute("class"), turn.text
        assert browser.execute_script("return state.lastRequest.model") == "sql"
        # the key is kept for the tab: a reload asks no more
        open_page(browser, url + "/")
        assert not by_css(browser, "#key-dialog[open]")


def run_under_prefix(driver, page_url: str, prefix: str, origin: str) -> None:
    open_page(driver, page_url)
    set_field(driver, "max_tokens", "6")
    send(driver, "hi")
    turn = last_turn(driver)
    assert turn.get_attribute("data-state") == "done", turn.text
    fetched = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert f"{origin}{prefix}/v1/models" in fetched and f"{origin}{prefix}/v1/chat/completions" in fetched
    assert any(name.startswith(f"{origin}{prefix}/ui/app.js?v=") for name in fetched)
    assert driver.execute_script("return document.baseURI") == f"{origin}{prefix}/"


def test_root_path(tiny_llama_dir, browser):
    with running_server(tiny_llama_dir, max_total_tokens=64, root_path="/llm/ember") as (url, _):
        # a proxy that forwards the prefix, and one that strips it: the same app answers both
        run_under_prefix(browser, url + "/llm/ember/", "/llm/ember", url)
        run_under_prefix(browser, url + "/llm/ember/ui", "/llm/ember", url)
        assert httpx.get(url + "/v1/models").status_code == 200
        r = httpx.post(url + "/llm/ember/v1/chat/completions", json={"model": "x", "messages": []})
        assert r.status_code in (400, 422) and "error" in r.json()  # OpenAI's error shape under the prefix too


def test_mounted_under_a_parent_app(tiny_llama_dir, browser):
    def mount(app):
        return Starlette(routes=[Mount("/apps/ember", app=app)], lifespan=lambda _: app.router.lifespan_context(app))

    with running_server(tiny_llama_dir, max_total_tokens=64, wrap=mount) as (url, _):
        run_under_prefix(browser, url + "/apps/ember/", "/apps/ember", url)


# -- images in chat messages ----------------------------------------------------------------------
LLAVA = "tiny-llava"
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory):
    """A tiny random LLaVA (it takes images; "<image>" is its placeholder)."""
    from ember.testing.tiny_vlms import make_tiny_llava

    path = tmp_path_factory.mktemp("tiny-llava")
    make_tiny_llava(path, seed=3)
    with running_server(path, max_total_tokens=256, served_model_name=LLAVA) as running:
        yield running


@pytest.fixture(scope="module")
def llava_http(llava_server):
    with httpx.Client(base_url=llava_server.url, timeout=60) as client:
        yield client


def picture(kind: int, size: tuple[int, int] = (96, 72)) -> bytes:
    """A small PNG that looks like something (a gradient, a shape): distinct for each kind."""
    from PIL import Image, ImageDraw

    width, height = size
    image = Image.new("RGB", size)
    pixels = image.load()
    for x in range(width):
        for y in range(height):
            pixels[x, y] = ((40 + 70 * kind + 2 * x) % 256, (90 + y * 2) % 256, (200 - 50 * kind) % 256)
    draw = ImageDraw.Draw(image)
    box = (width // 4, height // 4, 3 * width // 4, 3 * height // 4)
    (draw.ellipse if kind % 2 else draw.rectangle)(box, fill=((255 * kind) % 256, 230, 60 * kind % 256))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def attach_by_picker(driver, path: Path) -> None:
    """As a user choosing a file in the "Attach images" dialog."""
    by_css(driver, "#image-input")[0].send_keys(str(path))


def dispatch_files(driver, kind: str, files: list[tuple[str, str, bytes | int]], text: str | None = None) -> dict:
    """A paste (``kind="paste"``) into the message box or a drag and drop onto it, carrying
    these files ((name, type, bytes, or a size for zeros)) and ``text``, as the browser
    dispatches them; what the page did with the events."""
    payload = [(name, media_type, base64.b64encode(data).decode() if isinstance(data, bytes) else data)
               for name, media_type, data in files]
    return driver.execute_script("""
        const [kind, files, text] = arguments;
        const transfer = new DataTransfer();
        for (const [name, type, data] of files) {
          const bytes = typeof data === 'number' ? new Uint8Array(data)
            : Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
          transfer.items.add(new File([bytes], name, {type}));
        }
        if (text !== null) transfer.setData('text/plain', text);
        const box = document.getElementById('prompt');
        const init = {bubbles: true, cancelable: true};
        if (kind === 'paste') {
          const kept = box.dispatchEvent(new ClipboardEvent('paste', {...init, clipboardData: transfer}));
          return {defaultPrevented: !kept};
        }
        box.dispatchEvent(new DragEvent('dragenter', {...init, dataTransfer: transfer}));
        const overPrevented = !box.dispatchEvent(new DragEvent('dragover', {...init, dataTransfer: transfer}));
        const highlighted = box.classList.contains('dropping');
        const kept = box.dispatchEvent(new DragEvent('drop', {...init, dataTransfer: transfer}));
        const highlightedAfter = box.classList.contains('dropping');
        return {overPrevented, highlighted, defaultPrevented: !kept, highlightedAfter};
    """, kind, payload, text)


def attachments(driver, count: int) -> list:
    """The composer's thumbnails once ``count`` are there, each read (its data: URL shown)."""
    def ready(d):
        items = by_css(d, "#attachments .attachment")
        done = len(items) == count and all(
            (i.find_element("css selector", "img").get_attribute("src") or "").startswith("data:image/") for i in items)
        return done and items
    return wait_for(driver, ready, f"not {count} attached images") if count else []


def text_of(driver, element) -> str:
    """An element's exact text (Selenium's `.text` normalizes the whitespace of random tokens)."""
    return driver.execute_script("return arguments[0].textContent", element)


def api_answer(http, messages: list[dict], max_tokens: int = 8) -> str:
    r = http.post("/v1/chat/completions", json={"model": LLAVA, "messages": messages, "max_tokens": max_tokens,
                                                "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def not_shown(driver, element_id: str) -> bool:
    script = "return getComputedStyle(document.getElementById(arguments[0])).display"
    return driver.execute_script(script, element_id) == "none"


def severe_console(driver) -> list:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_image_from_the_file_picker_is_sent_and_answered_as_by_the_api(llava_server, llava_http, browser, tmp_path):
    browser.get_log("browser")  # what earlier tests left
    cat = picture(1)
    open_page(browser, llava_server.url + "/")
    assert [o.get_attribute("value") for o in by_css(browser, "#model option")] == [LLAVA]
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "8")
    assert not_shown(browser, "attachments") and not_shown(browser, "schema-box")  # [hidden] wins over display rules
    attach_by_picker(browser, write(tmp_path, "cat.png", cat))
    [item] = attachments(browser, 1)
    thumb = item.find_element("css selector", "img")
    assert thumb.is_displayed() and thumb.get_attribute("src") == data_url(cat)
    assert thumb.get_attribute("alt") == "cat.png" and item.find_element("css selector", ".remove").is_displayed()
    send(browser, QUESTION)
    turn = last_turn(browser)
    assert "error" not in turn.get_attribute("class"), turn.text
    shown = text_of(browser, turn.find_element("css selector", ".content"))
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image_part(cat)]}]
    sent = browser.execute_script("return state.lastRequest")
    assert sent["messages"] == messages and sent["temperature"] == 0 and sent["max_tokens"] == 8
    assert shown == api_answer(llava_http, messages)
    assert shown != api_answer(llava_http, [{"role": "user", "content": QUESTION}])  # the image counted
    # the transcript shows what was sent; the composer is empty again
    sent_thumbs = by_css(browser, ".msg.user img.thumb")
    assert [t.get_attribute("src") for t in sent_thumbs] == [data_url(cat)] and sent_thumbs[0].is_displayed()
    assert not by_css(browser, "#attachments .attachment") and not_shown(browser, "attachments")
    # the next turn sends the image again, as part of the history
    send(browser, "and then?")
    wait_for(browser, lambda d: len(by_css(d, ".msg.assistant")) == 2, "no second answer")
    second = last_turn(browser)
    messages += [{"role": "assistant", "content": shown}, {"role": "user", "content": "and then?"}]
    assert browser.execute_script("return state.lastRequest.messages") == messages
    assert text_of(browser, second.find_element("css selector", ".content")) == api_answer(llava_http, messages)
    assert not severe_console(browser)  # no script error, no image refused by the page's CSP


def test_paste_and_drop_attach_in_order_and_thumbnails_remove(llava_server, llava_http, browser, tmp_path):
    cat, dog, owl = picture(1), picture(2), picture(3)
    open_page(browser, llava_server.url + "/")
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "8")
    attach_by_picker(browser, write(tmp_path, "cat.png", cat))
    attachments(browser, 1)
    assert dispatch_files(browser, "paste", [("image.png", "image/png", dog)])["defaultPrevented"]
    attachments(browser, 2)
    dropped = dispatch_files(browser, "drop", [("owl.png", "image/png", owl)])
    assert dropped == {"overPrevented": True, "highlighted": True, "defaultPrevented": True, "highlightedAfter": False}
    items = attachments(browser, 3)
    assert [i.find_element("css selector", "img").get_attribute("alt") for i in items] == \
        ["cat.png", "image.png", "owl.png"]  # in the order attached
    # text pasted or dropped is left to the browser: nothing is attached
    assert not dispatch_files(browser, "paste", [], text="plain words")["defaultPrevented"]
    assert not dispatch_files(browser, "drop", [], text="plain words")["defaultPrevented"]
    items[1].find_element("css selector", ".remove").click()
    items = attachments(browser, 2)
    assert [i.find_element("css selector", "img").get_attribute("src") for i in items] == [data_url(cat), data_url(owl)]
    send(browser, "Compare these.")
    turn = last_turn(browser)
    assert "error" not in turn.get_attribute("class"), turn.text
    parts = [{"type": "text", "text": "Compare these."}, image_part(cat), image_part(owl)]
    messages = [{"role": "user", "content": parts}]
    assert browser.execute_script("return state.lastRequest.messages") == messages
    assert text_of(browser, turn.find_element("css selector", ".content")) == api_answer(llava_http, messages)
    assert len(by_css(browser, ".msg.user img.thumb")) == 2


def test_only_images_within_the_size_limit_are_attached(llava_server, browser, tmp_path):
    open_page(browser, llava_server.url + "/")
    error = by_css(browser, "#attach-error")[0]
    assert not error.is_displayed()
    attach_by_picker(browser, write(tmp_path, "notes.txt", b"not a picture"))
    wait_for(browser, lambda d: error.is_displayed(), "a text file was attached silently")
    assert "notes.txt is not an image (text/plain)" in error.text
    dispatch_files(browser, "drop", [("huge.png", "image/png", 21 * 1024 * 1024)])
    assert "huge.png is 21.0 MiB, more than the 20.0 MiB an image may be" in error.text
    dispatch_files(browser, "paste", [("empty.png", "image/png", b"")])
    assert "empty.png is empty" in error.text
    assert not by_css(browser, "#attachments .attachment")
    assert browser.execute_script("return state.attachments.length") == 0
    attach_by_picker(browser, write(tmp_path, "cat.png", picture(1)))  # a good one clears the message
    attachments(browser, 1)
    assert not error.is_displayed()


def test_a_text_only_model_refuses_images(server, browser, tmp_path):
    open_page(browser, server.url + "/")
    set_field(browser, "max_tokens", "4")
    attach_by_picker(browser, write(tmp_path, "cat.png", picture(1)))
    attachments(browser, 1)
    send(browser, "hello")
    error = last_turn(browser)
    assert "error" in error.get_attribute("class")
    assert error.text.startswith("ERROR\nHTTP 400: ") and "takes no images" in error.text, error.text
    assert not by_css(browser, ".msg.assistant")
    # the refused message is shown as not sent and left out of the conversation, which goes on
    assert by_css(browser, ".msg.user")[0].get_attribute("data-state") == "refused"
    assert browser.execute_script("return state.history") == []
    send(browser, "hello")
    turn = wait_for(browser, lambda d: by_css(d, ".msg.assistant[data-state=done]"), "no answer without images")[0]
    assert len(by_css(browser, ".msg.error")) == 1
    assert browser.execute_script("return state.lastRequest.messages") == [{"role": "user", "content": "hello"}]
    assert turn.get_attribute("data-finish-reason") == "length"


def test_copy_as_curl_and_python_carry_the_images(llava_server, llava_http, browser, tmp_path):
    cat, owl = picture(1), picture(3)
    open_page(browser, llava_server.url + "/")
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "8")
    attach_by_picker(browser, write(tmp_path, "cat.png", cat))
    dispatch_files(browser, "drop", [("owl.png", "image/png", owl)])
    attachments(browser, 2)
    by_css(browser, "#prompt")[0].send_keys(QUESTION)
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image_part(cat), image_part(owl)]}]
    reference = api_answer(llava_http, messages)
    for button, command in (("#copy-curl", ["bash"]), ("#copy-python", [sys.executable])):
        by_css(browser, button)[0].click()
        wait_for(browser, lambda d: by_css(d, "#code-text")[0].text, "no snippet shown")
        code = browser.execute_script("return document.getElementById('code-text').textContent")
        assert data_url(cat) in code and data_url(owl) in code  # whole, not shortened
        script = tmp_path / "snippet"
        script.write_text(code + "\n")
        result = subprocess.run([*command, str(script)], capture_output=True, timeout=60)
        assert result.returncode == 0, result.stderr.decode()
        if button == "#copy-curl":
            events = [line[6:] for line in result.stdout.decode().split("\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(event) for event in events[:-1]]
            streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        else:
            streamed = result.stdout.decode().removesuffix("\n")
        assert streamed == reference
        by_css(browser, "#code-close")[0].click()
    assert len(attachments(browser, 2)) == 2  # copying sends nothing: the images are still attached


def test_screenshot_with_images(llava_server, browser, tmp_path):
    """An answered message with an image, two more attached for the next one."""
    browser.get_log("browser")  # the refusals of earlier tests
    open_page(browser, llava_server.url + "/")
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "16")
    attach_by_picker(browser, write(tmp_path, "cat.png", picture(1, (160, 120))))
    attachments(browser, 1)
    send(browser, QUESTION)
    last_turn(browser)
    attach_by_picker(browser, write(tmp_path, "dog.png", picture(2, (120, 160))))
    dispatch_files(browser, "paste", [("image.png", "image/png", picture(3))])
    attachments(browser, 2)
    by_css(browser, "#prompt")[0].send_keys("And these two?")
    target = Path(os.environ.get("EMBER_PLAYGROUND_IMAGES_SCREENSHOT") or tmp_path / "playground-images.png")
    target.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(target))
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not severe_console(browser)


def test_screenshot(server, browser, tmp_path):
    """The docs' picture, made as docs/tools/playground_screenshot.py makes it (with SmolLM2)."""
    browser.get_log("browser")  # what earlier tests left (their refused requests)
    target = Path(os.environ.get("EMBER_PLAYGROUND_SCREENSHOT") or tmp_path / "playground.png")
    take_screenshot(browser, server.url + "/", target)
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and target.stat().st_size > 20_000
    console = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not console, console  # no script error, no refused resource (CSP) during the whole session


def take_screenshot(driver, url: str, target: Path) -> None:
    """A short chat, then a JSON answer with logprobs, one token's tooltip open."""
    from selenium.webdriver.common.action_chains import ActionChains

    open_page(driver, url)
    set_field(driver, "system", "You are a helpful assistant.")
    set_field(driver, "max_tokens", "60")
    set_field(driver, "temperature", "0")
    send(driver, "What is the capital of France? Answer in one sentence.")
    last_turn(driver)
    set_field(driver, "mode", "json")
    set_field(driver, "schema", json.dumps(CITY_SCHEMA, indent=2))
    set_field(driver, "logprobs", True)
    send(driver, "Describe that city as JSON.")
    turn = last_turn(driver)
    tokens = turn.find_elements("css selector", ".tok")
    ActionChains(driver).move_to_element(tokens[min(6, len(tokens) - 1)]).perform()
    wait_for(driver, lambda d: by_css(d, "#tooltip")[0].is_displayed(), "no tooltip on hover")
    wait_for(driver, lambda d: by_css(d, "#stat-kv")[0].text.endswith("%"), "no KV-cache use from /metrics")
    target.parent.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(target))
