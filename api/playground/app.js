// Ember's playground (docs/playground.md): plain JS, no build step, nothing fetched but
// this server. Every URL is relative to the page's <base href> (the server's root path),
// so the page works behind a reverse proxy's path prefix.
"use strict";

const KEY_STORAGE = "ember-api-key";
const CHAT_PATH = "v1/chat/completions";
const MAX_IMAGE_BYTES = 20 * 1024 * 1024;  // the server's default --max-image-bytes
const DEFAULT_SCHEMA = {
  type: "object",
  properties: {
    name: { type: "string", maxLength: 20 },
    age: { type: "integer", minimum: 0, maximum: 120 },
  },
  required: ["name", "age"],
  additionalProperties: false,
};
const DEFAULT_TOOLS = [{
  type: "function",
  function: {
    name: "get_weather",
    description: "The current weather in a city",
    parameters: {
      type: "object",
      properties: { city: { type: "string", maxLength: 20 }, unit: { enum: ["celsius", "fahrenheit"] } },
      required: ["city", "unit"],
      additionalProperties: false,
    },
  },
}];

const $ = (id) => document.getElementById(id);
const state = {
  history: [],          // the conversation as chat messages
  lastRequest: null,    // the body of the last request sent
  controller: null,     // aborts the generation in flight
  keyPrompt: null,      // the pending API-key question, shared by concurrent 401s
  attachments: [],      // images for the next message, in the order attached: {name, size, url, ready}
  sending: false,       // a message is being sent (its images still being read)
};

// -- the API key -------------------------------------------------------------------
function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

function askKey(message) {
  if (state.keyPrompt) return state.keyPrompt;
  const dialog = $("key-dialog");
  $("key-message").textContent = message;
  $("key-input").value = "";
  state.keyPrompt = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      state.keyPrompt = null;
      const key = $("key-input").value.trim();
      if (dialog.returnValue === "save" && key) {
        sessionStorage.setItem(KEY_STORAGE, key);
        resolve(true);
      } else {
        resolve(false);
      }
    }, { once: true });
  });
  dialog.showModal();
  $("key-input").focus();
  return state.keyPrompt;
}

// fetch() for the API: the stored key as a bearer token; a 401 asks for the key and retries.
async function api(path, options = {}) {
  for (;;) {
    const headers = { ...(options.headers || {}) };
    const key = apiKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    const reason = await errorMessage(response);
    sessionStorage.removeItem(KEY_STORAGE);
    const prompt = key ? `The key was refused: ${reason}` : `This server needs an API key: ${reason}`;
    if (!(await askKey(prompt))) return new Response(JSON.stringify({ error: { message: reason } }), { status: 401 });
  }
}

// The message of an error body in any of the server's shapes (OpenAI, Anthropic, TGI).
async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const error = body.error;
    if (error && typeof error === "object") return error.message || JSON.stringify(error);
    if (typeof error === "string") return error;
    return text;
  } catch {
    return text || response.statusText;
  }
}

// -- models and metrics --------------------------------------------------------------
async function loadModels() {
  const select = $("model");
  const response = await api("v1/models");
  if (!response.ok) {
    showError(`Could not list the models (HTTP ${response.status}): ${await errorMessage(response)}`);
    return;
  }
  const body = await response.json();
  select.replaceChildren();
  for (const model of body.data) {
    const option = new Option(model.parent ? `${model.id} (adapter of ${model.parent})` : model.id, model.id);
    option.dataset.kind = model.parent ? "adapter" : "base";
    select.append(option);
  }
}

// The value of a Prometheus sample in the text exposition format (the first series).
function metricValue(text, name) {
  const pattern = new RegExp(`^${name}(?:\\{[^}]*\\})?\\s+(\\S+)`, "m");
  const match = text.match(pattern);
  return match ? Number(match[1]) : null;
}

async function pollMetrics() {
  try {
    const response = await fetch("metrics");
    if (response.ok) {
      const text = await response.text();
      const ratio = metricValue(text, "ember_kv_cache_usage_ratio");
      const used = metricValue(text, "ember_kv_cache_blocks_used");
      const total = metricValue(text, "ember_kv_cache_blocks_total");
      if (ratio !== null) {
        $("stat-kv").textContent = `${(100 * ratio).toFixed(1)}%`;
        $("stat-kv").title = used !== null && total !== null ? `${used} of ${total} blocks` : "";
      }
    }
  } catch {
    // the server is away for a moment: the next poll tries again
  }
}

// -- settings -> request -----------------------------------------------------------------
function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function parseTools() {
  const declared = JSON.parse($("tools").value);
  const list = Array.isArray(declared) ? declared : [declared];
  return list.map((tool) => (tool && tool.type === undefined && tool.name ? { type: "function", function: tool } : tool));
}

function refreshToolChoice() {
  const select = $("tool_choice");
  const previous = select.value;
  let names = [];
  try {
    names = parseTools().map((tool) => tool.function && tool.function.name).filter(Boolean);
    setSettingsError("");
  } catch (exc) {
    setSettingsError(`tools: not JSON (${exc.message})`);
  }
  select.replaceChildren(new Option("auto", "auto"), new Option("required", "required"), new Option("none", "none"));
  for (const name of names) select.append(new Option(`call ${name}`, `function:${name}`));
  if ([...select.options].some((option) => option.value === previous)) select.value = previous;
}

function setSettingsError(text) {
  $("settings-error").textContent = text;
  $("settings-error").hidden = !text;
}

function parseStop() {
  const text = $("stop").value;
  if (!text.trim()) return undefined;
  return text.split(",").map((part) => part.replaceAll("\\n", "\n")).filter((part) => part.length > 0);
}

// The chat request the form describes, for ``messages``; throws on a field that is not JSON.
function buildRequest(messages, isContinuation = false) {
  // a copy: the history grows after sending, the request sent (state.lastRequest) does not
  const body = { model: $("model").value, messages: [...messages], stream: true, stream_options: { include_usage: true } };
  const system = $("system").value.trim();
  if (system) body.messages = [{ role: "system", content: system }, ...messages];
  for (const name of ["temperature", "top_p", "max_tokens", "seed"]) {
    const value = numberField(name);
    if (value !== undefined) body[name] = value;
  }
  const stop = parseStop();
  if (stop) body.stop = stop;
  const mode = $("mode").value;
  if (mode === "json") {
    let schema;
    try {
      schema = JSON.parse($("schema").value);
    } catch (exc) {
      throw new Error(`JSON schema: not JSON (${exc.message})`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema, strict: true } };
  } else if (mode === "tools") {
    try {
      body.tools = parseTools();
    } catch (exc) {
      throw new Error(`tools: not JSON (${exc.message})`);
    }
    const choice = $("tool_choice").value || "auto";
    // after the tool's result, a forced call would only be forced again: the model answers freely
    if (isContinuation && choice !== "none") body.tool_choice = "auto";
    else body.tool_choice = choice.startsWith("function:")
      ? { type: "function", function: { name: choice.slice("function:".length) } } : choice;
  }
  if ($("logprobs").checked) {
    body.logprobs = true;
    const top = numberField("top_logprobs");
    if (top !== undefined) body.top_logprobs = top;
  }
  return body;
}

// -- the conversation's DOM -------------------------------------------------------------
function addMessage(role, text, images = []) {
  const element = document.createElement("div");
  element.className = `msg ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text || "";
  element.append(label, content);
  if (images.length) {
    const box = document.createElement("div");
    box.className = "images";
    for (const image of images) {
      const img = thumbnail(image);
      img.addEventListener("click", () => img.classList.toggle("large"));
      box.append(img);
    }
    element.append(box);
  }
  $("messages").append(element);
  element.scrollIntoView({ block: "end" });
  return element;
}

function showError(text) {
  const element = addMessage("error", text);
  element.setAttribute("role", "alert");
  return element;
}

function tokenSpan(entry) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = entry.token;
  span.tokenLogprobs = entry;
  const p = Math.exp(entry.logprob);
  span.style.setProperty("--p", p.toFixed(3));
  return span;
}

function showTooltip(event) {
  const span = event.target.closest(".tok");
  const tooltip = $("tooltip");
  if (!span) {
    tooltip.hidden = true;
    return;
  }
  const entry = span.tokenLogprobs;
  const rows = [{ token: entry.token, logprob: entry.logprob, chosen: true }, ...(entry.top_logprobs || [])];
  const table = document.createElement("table");
  for (const row of rows) {
    const tr = table.insertRow();
    if (row.chosen) tr.className = "chosen";
    tr.insertCell().textContent = JSON.stringify(row.token);
    tr.insertCell().textContent = row.logprob.toFixed(3);
    tr.insertCell().textContent = `${(100 * Math.exp(row.logprob)).toFixed(1)}%`;
  }
  tooltip.replaceChildren(table);
  tooltip.hidden = false;
  const rect = span.getBoundingClientRect();
  tooltip.style.left = `${Math.min(rect.left, window.innerWidth - 260)}px`;
  tooltip.style.top = `${rect.bottom + 6}px`;
}

// -- streaming a chat completion ------------------------------------------------------------
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

class Turn {
  constructor(element, started) {
    this.element = element;
    this.content = element.querySelector(".content");
    this.started = started;
    this.firstTokenAt = null;
    this.numTokens = 0;
    this.text = "";
    this.reasoning = "";
    this.calls = [];
    this.finishReason = null;
    this.usage = null;
    this.element.dataset.state = "streaming";
    this.element.dataset.updates = "0";
  }

  onChunk(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      let isToken = false;
      if (delta.reasoning_content) {
        this.reasoning += delta.reasoning_content;
        isToken = true;
      }
      if (delta.content) {
        this.text += delta.content;
        isToken = true;
        const tokens = choice.logprobs && choice.logprobs.content;
        if (tokens && tokens.length) {
          for (const entry of tokens) this.content.append(tokenSpan(entry));
        } else if (!$("logprobs").checked) {
          this.content.textContent = this.text;
        } else {
          this.content.append(document.createTextNode(delta.content));
        }
      }
      for (const piece of delta.tool_calls || []) {
        isToken = true;
        const call = this.calls[piece.index] || (this.calls[piece.index] = { id: "", name: "", arguments: "" });
        if (piece.id) call.id = piece.id;
        if (piece.function && piece.function.name) call.name = piece.function.name;
        if (piece.function && piece.function.arguments) call.arguments += piece.function.arguments;
        this.renderCalls(false);
      }
      if (choice.finish_reason) this.finishReason = choice.finish_reason;
      if (isToken) this.countToken(choice.logprobs && choice.logprobs.content ? choice.logprobs.content.length : 1);
    }
    if (this.reasoning) this.renderReasoning();
  }

  countToken(count) {
    const now = performance.now();
    if (this.firstTokenAt === null) {
      this.firstTokenAt = now;
      $("stat-ttft").textContent = `${Math.round(now - this.started)} ms`;
    }
    this.numTokens += count;
    this.element.dataset.updates = String(Number(this.element.dataset.updates) + 1);
    this.showRate(now);
  }

  showRate(now) {
    const seconds = (now - this.firstTokenAt) / 1000;
    $("stat-tokens").textContent = String(this.numTokens);
    if (this.numTokens > 1 && seconds > 0) $("stat-tps").textContent = ((this.numTokens - 1) / seconds).toFixed(1);
  }

  renderReasoning() {
    let box = this.element.querySelector(".reasoning");
    if (!box) {
      box = document.createElement("details");
      box.className = "reasoning";
      box.append(Object.assign(document.createElement("summary"), { textContent: "reasoning" }), document.createElement("div"));
      this.content.before(box);
    }
    box.lastChild.textContent = this.reasoning;
  }

  renderCalls(isDone) {
    let box = this.element.querySelector(".tool-calls");
    if (!box) {
      box = document.createElement("div");
      box.className = "tool-calls";
      this.element.append(box);
    }
    box.replaceChildren();
    for (const call of this.calls.filter(Boolean)) {
      const card = document.createElement("div");
      card.className = "tool-call";
      card.dataset.callId = call.id;
      const title = Object.assign(document.createElement("div"), { className: "tool-name", textContent: `call ${call.name}` });
      const args = Object.assign(document.createElement("pre"), { className: "tool-args", textContent: prettyJSON(call.arguments) });
      card.append(title, args);
      if (isDone) {
        const result = Object.assign(document.createElement("textarea"), { className: "tool-result", rows: 2 });
        result.placeholder = `the result of ${call.name}, sent back as a "tool" message`;
        card.append(result);
      }
      box.append(card);
    }
    if (isDone) {
      const send = Object.assign(document.createElement("button"), { type: "button", className: "tool-send", textContent: "Send tool results" });
      send.addEventListener("click", () => sendToolResults(box, this.calls.filter(Boolean), send));
      box.append(send);
    }
  }

  finish() {
    const now = performance.now();
    if (this.usage) this.numTokens = this.usage.completion_tokens;
    if (this.firstTokenAt !== null) this.showRate(now);
    if (this.calls.length) this.renderCalls(true);
    if ($("mode").value === "json" && !this.calls.length) this.renderJSON();
    const message = { role: "assistant", content: this.text || null };
    if (this.calls.length) {
      message.tool_calls = this.calls.filter(Boolean).map((call) => ({
        id: call.id, type: "function", function: { name: call.name, arguments: call.arguments },
      }));
    }
    this.element.dataset.state = "done";
    if (this.finishReason) this.element.dataset.finishReason = this.finishReason;
    return message;
  }

  renderJSON() {
    const box = document.createElement("div");
    box.className = "json-view";
    try {
      const value = JSON.parse(this.text);
      box.append(Object.assign(document.createElement("div"), { className: "json-ok", textContent: "valid JSON" }),
        Object.assign(document.createElement("pre"), { className: "json", textContent: JSON.stringify(value, null, 2) }));
    } catch (exc) {
      box.append(Object.assign(document.createElement("div"), { className: "json-error", textContent: `not JSON: ${exc.message}` }));
    }
    this.element.append(box);
  }
}

function prettyJSON(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

function setBusy(isBusy) {
  $("send").disabled = isBusy;
  $("stop-generation").disabled = !isBusy;
}

// Sends the conversation and streams the answer into a new assistant message; false
// when the request was not sent or the server refused it (nothing joined the history).
async function complete(isContinuation) {
  let body;
  try {
    body = buildRequest(state.history, isContinuation);
  } catch (exc) {
    showError(exc.message);
    return false;
  }
  state.lastRequest = body;
  state.controller = new AbortController();
  setBusy(true);
  const element = addMessage("assistant", "");
  const turn = new Turn(element, performance.now());
  try {
    const response = await api(CHAT_PATH, {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) {
      element.remove();
      showError(`HTTP ${response.status}: ${await errorMessage(response)}`);
      return false;
    }
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        showError(`error during generation: ${chunk.error.message || JSON.stringify(chunk.error)}`);
        element.dataset.state = "error";
        return;
      }
      turn.onChunk(chunk);
    }
    state.history.push(turn.finish());
  } catch (exc) {
    if (exc.name === "AbortError") {
      state.history.push(turn.finish());
      element.dataset.finishReason = "stopped";
    } else {
      element.dataset.state = "error";
      showError(`request failed: ${exc.message}`);
    }
  } finally {
    setBusy(false);
    state.controller = null;
    pollMetrics();
  }
  return true;
}

// The user message of ``text`` and the attached images: plain text, or OpenAI's content
// parts (the text, then one image_url part per image, in the order attached).
function userMessage(text, images) {
  if (!images.length) return { role: "user", content: text };
  const parts = text.trim() ? [{ type: "text", text }] : [];
  for (const image of images) parts.push({ type: "image_url", image_url: { url: image.url } });
  return { role: "user", content: parts };
}

async function sendMessage(event) {
  event.preventDefault();
  if (state.controller || state.sending) return;
  state.sending = true;
  try {
    while (state.attachments.some((entry) => !entry.url)) await attachmentsRead();
    const text = $("prompt").value;
    const images = [...state.attachments];
    if (!text.trim() && !images.length) return;
    $("prompt").value = "";
    state.attachments = [];
    renderAttachments();
    setAttachError("");
    const element = addMessage("user", text, images);
    const message = userMessage(text, images);
    state.history.push(message);
    const isSent = await complete(false);
    if (isSent === false && state.history[state.history.length - 1] === message) {
      // refused (e.g. images for a text-only model): the message leaves the conversation
      state.history.pop();
      element.dataset.state = "refused";
      element.title = "not part of the conversation: the request was refused";
    }
  } finally {
    state.sending = false;
  }
}

async function sendToolResults(box, calls, button) {
  const results = [...box.querySelectorAll(".tool-result")];
  calls.forEach((call, i) => {
    const content = results[i].value;
    results[i].readOnly = true;
    state.history.push({ role: "tool", tool_call_id: call.id, content });
  });
  button.disabled = true;
  await complete(true);
}

// -- images attached to the next message -------------------------------------------------------
// Read in the browser as data: URLs and sent inside the chat request; nothing is uploaded before.
function formatBytes(size) {
  if (size < 1024) return `${size} B`;
  if (size < 1024 * 1024) return `${(size / 1024).toFixed(1)} KiB`;
  return `${(size / 1024 / 1024).toFixed(1)} MiB`;
}

function setAttachError(text) {
  $("attach-error").textContent = text;
  $("attach-error").hidden = !text;
}

function readDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.addEventListener("load", () => resolve(reader.result));
    reader.addEventListener("error", () => reject(reader.error || new Error("unreadable")));
    reader.readAsDataURL(file);
  });
}

// Attaches the image files among ``files`` (in their order); what is refused is said.
function attachFiles(files) {
  const problems = [];
  for (const file of files) {
    const name = file.name || "pasted image";
    if (!file.type.startsWith("image/")) {
      problems.push(`${name} is not an image (${file.type || "unknown type"})`);
    } else if (file.size > MAX_IMAGE_BYTES) {
      problems.push(`${name} is ${formatBytes(file.size)}, more than the ${formatBytes(MAX_IMAGE_BYTES)} an image may be`);
    } else if (file.size === 0) {
      problems.push(`${name} is empty`);
    } else {
      const entry = { name, size: file.size, type: file.type, url: null };
      entry.ready = readDataURL(file).then((url) => {
        entry.url = url;
        renderAttachments();
      }, (exc) => {
        state.attachments = state.attachments.filter((other) => other !== entry);
        renderAttachments();
        setAttachError(`${name} could not be read: ${exc.message}`);
      });
      state.attachments.push(entry);
    }
  }
  setAttachError(problems.length ? `Not attached: ${problems.join("; ")}.` : "");
  renderAttachments();
}

// Waits for the images still being read (a failed read has removed its image).
async function attachmentsRead() {
  await Promise.all(state.attachments.map((entry) => entry.ready));
}

function thumbnail(image) {
  const img = document.createElement("img");
  img.className = "thumb";
  img.alt = image.name;
  img.title = `${image.name} (${formatBytes(image.size)})`;
  if (image.url) img.src = image.url;
  return img;
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  state.attachments.forEach((entry) => {
    const item = document.createElement("div");
    item.className = "attachment";
    if (!entry.url) item.dataset.state = "reading";
    const remove = Object.assign(document.createElement("button"), {
      type: "button", className: "remove", textContent: "×", title: `remove ${entry.name}`,
    });
    remove.setAttribute("aria-label", `remove ${entry.name}`);
    remove.addEventListener("click", () => {
      state.attachments = state.attachments.filter((other) => other !== entry);
      renderAttachments();
      $("prompt").focus();
    });
    item.append(thumbnail(entry), remove);
    box.append(item);
  });
  box.hidden = !state.attachments.length;
}

function imageFiles(dataTransfer) {
  return dataTransfer ? [...dataTransfer.files] : [];
}

function hasFiles(event) {
  return event.dataTransfer && [...event.dataTransfer.types].includes("Files");
}

function onPaste(event) {
  const files = imageFiles(event.clipboardData);
  if (!files.length) return;  // text: pasted as usual
  attachFiles(files);
  if (![...event.clipboardData.types].includes("text/plain")) event.preventDefault();
}

function onDragOver(event) {
  if (!hasFiles(event)) return;  // dragged text: dropped as usual
  event.preventDefault();
  event.dataTransfer.dropEffect = "copy";
  $("prompt").classList.add("dropping");
}

function onDrop(event) {
  $("prompt").classList.remove("dropping");
  if (!hasFiles(event)) return;
  event.preventDefault();  // not the browser's own opening of the file
  attachFiles(imageFiles(event.dataTransfer));
}

// -- copy as curl / Python --------------------------------------------------------------------
// The request Send would make now (the typed message and the attached images, whole), or
// the last one sent when nothing is typed or attached.
function currentRequest() {
  const text = $("prompt").value;
  const images = state.attachments.filter((entry) => entry.url);
  if (!text.trim() && !images.length && state.lastRequest) return state.lastRequest;
  const messages = text.trim() || images.length ? [...state.history, userMessage(text, images)] : state.history;
  return buildRequest(messages);
}

function baseURL() {
  return new URL(".", document.baseURI).href;
}

function curlCommand(body) {
  const lines = [`curl -sN ${baseURL()}${CHAT_PATH}`, `  -H "Content-Type: application/json"`];
  if (apiKey()) lines.push(`  -H "Authorization: Bearer $EMBER_API_KEY"`);
  lines.push("  -d @- <<'EOF'");
  return `${lines.join(" \\\n")}\n${JSON.stringify(body, null, 2)}\nEOF\n`;
}

// A JSON value as a Python literal.
function pyLiteral(value, indent = "") {
  const inner = `${indent}    `;
  if (value === null || value === undefined) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value === "number" || typeof value === "string") return JSON.stringify(value);
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    return `[\n${value.map((item) => inner + pyLiteral(item, inner)).join(",\n")},\n${indent}]`;
  }
  const entries = Object.entries(value);
  if (!entries.length) return "{}";
  return `{\n${entries.map(([k, v]) => `${inner}${JSON.stringify(k)}: ${pyLiteral(v, inner)}`).join(",\n")},\n${indent}}`;
}

function pythonSnippet(body) {
  return [
    "import os",
    "",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url=${JSON.stringify(`${baseURL()}v1`)}, api_key=os.environ.get("EMBER_API_KEY", "none"))`,
    `request = ${pyLiteral(body)}`,
    "response = client.chat.completions.create(**request)",
    "if request.get(\"stream\"):",
    "    for chunk in response:",
    "        if chunk.choices and chunk.choices[0].delta.content:",
    "            print(chunk.choices[0].delta.content, end=\"\", flush=True)",
    "    print()",
    "else:",
    "    print(response.choices[0].message)",
    "",
  ].join("\n");
}

async function showCode(title, make) {
  while (state.attachments.some((entry) => !entry.url)) await attachmentsRead();
  let text;
  try {
    text = make(currentRequest());
  } catch (exc) {
    showError(exc.message);
    return;
  }
  $("code-title").textContent = title;
  $("code-text").textContent = text;
  $("code-status").textContent = "";
  $("code-dialog").showModal();
  await copyText(text);
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    $("code-status").textContent = "copied to the clipboard";
  } catch {
    $("code-status").textContent = "select the text to copy it";
  }
}

// -- wiring --------------------------------------------------------------------------------------
function showMode() {
  const mode = $("mode").value;
  $("schema-box").hidden = mode !== "json";
  $("tools-box").hidden = mode !== "tools";
}

function init() {
  $("schema").value = JSON.stringify(DEFAULT_SCHEMA, null, 2);
  $("tools").value = JSON.stringify(DEFAULT_TOOLS, null, 2);
  refreshToolChoice();
  showMode();
  $("mode").addEventListener("change", showMode);
  $("tools").addEventListener("input", refreshToolChoice);
  $("composer").addEventListener("submit", sendMessage);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop-generation").addEventListener("click", () => state.controller && state.controller.abort());
  $("attach").addEventListener("click", () => $("image-input").click());
  $("image-input").addEventListener("change", () => {
    attachFiles([...$("image-input").files]);
    $("image-input").value = "";  // the same file may be attached again
  });
  $("prompt").addEventListener("paste", onPaste);
  $("prompt").addEventListener("dragenter", onDragOver);
  $("prompt").addEventListener("dragover", onDragOver);
  $("prompt").addEventListener("dragleave", () => $("prompt").classList.remove("dropping"));
  $("prompt").addEventListener("drop", onDrop);
  $("clear").addEventListener("click", () => {
    state.history = [];
    $("messages").replaceChildren();
  });
  $("copy-curl").addEventListener("click", () => showCode("curl", curlCommand));
  $("copy-python").addEventListener("click", () => showCode("Python (openai SDK)", pythonSnippet));
  $("code-copy").addEventListener("click", () => copyText($("code-text").textContent));
  $("code-close").addEventListener("click", () => $("code-dialog").close());
  $("messages").addEventListener("mouseover", showTooltip);
  $("messages").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  loadModels();
  pollMetrics();
  setInterval(() => { if (!document.hidden) pollMetrics(); }, 2000);
}

document.addEventListener("DOMContentLoaded", init);
