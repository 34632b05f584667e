"""`ember chat`: an interactive chat in the terminal, with a running server (``--url``)
or a model loaded in this process (the same server, started on a free local port).

Both ways go through the HTTP chat route, so what the terminal shows is what any client
gets: the answer streamed as it is generated, then a line of figures (tokens, tokens/s,
time to the first token). Lines starting with ``/`` are commands (``/help`` lists them;
``/image PATH`` attaches an image file to the next message, sent inside the request as a
``data:`` URL ``image_url`` part, for a model that takes images);
Ctrl-C stops a generation (the server drops the request) and keeps the program;
Ctrl-D or ``/exit`` leaves. Errors the server answers (a 4xx with its message) are shown
and the chat goes on. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

HELP = """commands:
  /system [TEXT]        show the system prompt, or set it (/system - clears it)
  /params [KEY=VALUE]   show the request parameters, or set them: temperature=0.7 max_tokens=200
                        seed=1 stop=["\\n"] (values are JSON when they parse, else text; KEY= unsets)
  /image [PATH]         attach an image file (PNG, JPEG, GIF, WebP, BMP, TIFF) to the next message
                        (repeat for several); /image lists the attached ones, /image - drops them
  /reset                forget the conversation (the system prompt and parameters stay)
  /history              show the conversation so far
  /help                 this list
  /exit, /quit          leave (as Ctrl-D); Ctrl-C stops a generation"""
PROMPT = ">>> "
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # the server's default --max-image-bytes
# the image formats the server reads (ember.multimodal.image), by their files' first bytes
IMAGE_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"), (b"BM", "image/bmp"), (b"II*\x00", "image/tiff"), (b"MM\x00*", "image/tiff"),
)


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("chat")
    group.add_argument(
        "--url", dest="chat_url", metavar="URL", default=None,
        help="a running Ember (or other OpenAI-compatible) server, e.g. http://127.0.0.1:3000; "
        "default: load the model in this process [EMBER_CHAT_URL]",
    )
    group.add_argument("--api-key", metavar="KEY", default=None, help="the server's API key [EMBER_API_KEY]")
    group.add_argument("--model", dest="chat_model", metavar="NAME", default=None,
                       help="the model (or LoRA adapter) name to ask for; default: the server's first model")
    group.add_argument("--system", metavar="TEXT", default=None, help="a system prompt to start with")


class ChatError(Exception):
    """A refusal to show the user (the server's message), after which the chat goes on."""


def _media_type(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((kind for signature, kind in IMAGE_SIGNATURES if data.startswith(signature)), None)


def image_data_url(path: str) -> str:
    """The image file at ``path`` as a ``data:`` URL; ChatError (one line) when it is
    missing, unreadable, too big or not an image."""
    shown = repr(path)
    try:
        size = os.path.getsize(path)
        if os.path.isdir(path):
            raise IsADirectoryError
        if size > MAX_IMAGE_BYTES:
            raise ChatError(f"cannot attach {shown}: {size / 2**20:.1f} MiB, more than the "
                            f"{MAX_IMAGE_BYTES // 2**20} MiB an image may be")
        with open(path, "rb") as file:
            data = file.read(MAX_IMAGE_BYTES + 1)
    except FileNotFoundError:
        raise ChatError(f"cannot attach {shown}: no such file") from None
    except IsADirectoryError:
        raise ChatError(f"cannot attach {shown}: it is a directory") from None
    except PermissionError:
        raise ChatError(f"cannot attach {shown}: permission denied") from None
    except OSError as exc:
        raise ChatError(f"cannot attach {shown}: {exc.strerror or exc}") from None
    if not data:
        raise ChatError(f"cannot attach {shown}: the file is empty")
    media_type = _media_type(data)
    if media_type is None:
        raise ChatError(f"cannot attach {shown}: not an image (PNG, JPEG, GIF, WebP, BMP or TIFF)")
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


def _size(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} B"
    return f"{num_bytes / 1024:.1f} KiB" if num_bytes < 2**20 else f"{num_bytes / 2**20:.1f} MiB"


def _unquote(text: str) -> str:
    """A path as typed: surrounding quotes dropped (a pasted or dragged path has them), ~ expanded."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return os.path.expanduser(text)


class Chat:
    """One conversation with a server's /v1/chat/completions: its history, system
    prompt and request parameters; `ask` streams one answer to ``out``."""

    def __init__(self, url: str, model: str, api_key: str | None = None, system: str | None = None,
                 params: dict[str, Any] | None = None, out: TextIO = sys.stdout) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(600, connect=10))
        self.model, self.system, self.out = model, system, out
        self.params: dict[str, Any] = dict(params or {})
        self.messages: list[dict[str, Any]] = []
        self.images: list[tuple[str, str]] = []  # attached to the next message: (path, data: URL)
        self.image_names: dict[str, str] = {}  # data: URL -> the path it was read from, for /history

    def close(self) -> None:
        self.http.close()

    def user_message(self, text: str) -> dict[str, Any]:
        """``text`` as a user message: with images attached, OpenAI's content parts (the
        text, then one ``image_url`` part per image in the order attached)."""
        if not self.images:
            return {"role": "user", "content": text}
        parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        parts += [{"type": "image_url", "image_url": {"url": url}} for _, url in self.images]
        return {"role": "user", "content": parts}

    def request(self, text: str) -> dict[str, Any]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {**self.params, "model": self.model, "messages": system + self.messages + [self.user_message(text)],
                "stream": True, "stream_options": {"include_usage": True}}

    def ask(self, text: str) -> str:
        """Stream the answer to ``text``; it joins the history (cut short by Ctrl-C too,
        then marked so). ChatError for a refusal: the history is left as it was."""
        body = self.request(text)
        pieces: list[str] = []
        usage: dict[str, Any] = {}
        start, first = time.perf_counter(), None
        stopped = False
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    message = _error_message(response.status_code, response.read())
                    if self.images:
                        count = len(self.images)
                        message += (f"\n(the {count} attached image{'s' if count > 1 else ''} "
                                    f"stay{'' if count > 1 else 's'} attached; /image - drops them)")
                    raise ChatError(message)
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise ChatError(_error_message(500, json.dumps(chunk).encode()))
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content") or ""
                        if piece:
                            first = first or time.perf_counter()
                            pieces.append(piece)
                            self.out.write(piece)
                            self.out.flush()
        except KeyboardInterrupt:  # closing the stream makes the server drop the request
            stopped = True
        except OSError as exc:  # httpx's transport errors are OSErrors underneath too
            raise ChatError(f"the server could not be reached: {exc}") from None
        except Exception as exc:
            if exc.__class__.__module__.startswith("httpx"):
                raise ChatError(f"the server could not be reached: {exc}") from None
            raise
        answer = "".join(pieces)
        self.messages += [body["messages"][-1], {"role": "assistant", "content": answer}]
        self.images = []  # sent: they are in the history now, and go with every later turn
        self.out.write("\n")
        self.out.write(_figures(len(pieces), usage, start, first, stopped) + "\n")
        self.out.flush()
        return answer

    def command(self, line: str) -> bool:
        """Run one ``/`` command; False when the chat should end."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/help":
            self.out.write(HELP + "\n")
        elif name == "/reset":
            self.messages.clear()
            self.out.write("the conversation is forgotten\n")
        elif name == "/system":
            if rest:
                self.system = None if rest == "-" else rest
            self.out.write(f"system prompt: {self.system!r}\n" if self.system else "no system prompt\n")
        elif name == "/params":
            self.set_params(rest)
            self.out.write(f"parameters: {json.dumps(self.params)}\n")
        elif name == "/image":
            self.image_command(rest)
        elif name == "/history":
            for message in ([{"role": "system", "content": self.system}] if self.system else []) + self.messages:
                self.out.write(f"{message['role']}: {self._shown(message['content'])}\n")
        else:
            self.out.write(f"unknown command {name!r}; /help lists them\n")
        self.out.flush()
        return True

    def image_command(self, rest: str) -> None:
        """``/image PATH`` attaches, ``/image -`` drops them all, ``/image`` lists them."""
        if rest == "-":
            count = len(self.images)
            self.images = []
            self.out.write(f"dropped {count} attached image{'' if count == 1 else 's'}\n")
        elif rest:
            path = _unquote(rest)
            url = image_data_url(path)
            self.images.append((path, url))
            self.image_names[url] = path
            encoded = url.partition(",")[2]
            size = len(encoded) * 3 // 4 - (len(encoded) - len(encoded.rstrip("=")))
            self.out.write(f"attached {path} ({_size(size)}, {url[5:url.index(';')]}); {len(self.images)} image"
                           f"{'' if len(self.images) == 1 else 's'} for the next message\n")
        elif self.images:
            self.out.write("attached to the next message:\n")
            for i, (path, _) in enumerate(self.images, 1):
                self.out.write(f"  {i}. {path}\n")
        else:
            self.out.write("no image attached (/image PATH attaches one)\n")

    def _shown(self, content: Any) -> str:
        """A message's content for /history: its text, each image as [image PATH]."""
        if isinstance(content, str) or content is None:
            return content or ""
        pieces = []
        for part in content:
            if part.get("type") == "image_url":
                pieces.append(f"[image {self.image_names.get(part['image_url']['url'], '')}]".replace(" ]", "]"))
            else:
                pieces.append(part.get("text", ""))
        return " ".join(pieces)

    def set_params(self, text: str) -> None:
        for item in text.split():
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ChatError(f"{item!r}: write parameters as KEY=VALUE, e.g. temperature=0.7")
            if key in ("model", "messages", "stream", "stream_options"):
                raise ChatError(f"{key!r} is set by the chat itself" + (" (use --model)" if key == "model" else ""))
            if not value:
                self.params.pop(key, None)
                continue
            try:
                self.params[key] = json.loads(value)
            except json.JSONDecodeError:
                self.params[key] = value


def _error_message(status: int, body: bytes) -> str:
    try:
        error = json.loads(body)
        error = error.get("error", error) if isinstance(error, dict) else error
        message = error.get("message") if isinstance(error, dict) else error
    except (json.JSONDecodeError, UnicodeDecodeError):
        message = body.decode(errors="replace")[:500]
    return f"the server refused ({status}): {message}"


def _figures(num_pieces: int, usage: dict[str, Any], start: float, first: float | None, stopped: bool) -> str:
    tokens = usage.get("completion_tokens", num_pieces)
    end = time.perf_counter()
    parts = ["stopped" if stopped else f"{tokens} tokens"]
    if first is not None:
        parts.append(f"first token {first - start:.2f} s")
        if tokens > 1 and end > first:
            parts.append(f"{(tokens - 1) / (end - first):.1f} tokens/s")
    return "[" + ", ".join(parts) + "]"


def repl(chat: Chat, read: Callable[[str], str] = input) -> int:
    """Read lines until Ctrl-D or /exit; each line a message or a command."""
    while True:
        try:
            line = read(PROMPT)
        except EOFError:
            chat.out.write("\n")
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, not the end
            chat.out.write("\n(Ctrl-D or /exit to leave)\n")
            continue
        if not line.strip():
            continue
        is_command = line.startswith("/")
        try:
            if is_command:
                if not chat.command(line.strip()):
                    return 0
            else:
                chat.ask(line)
        except ChatError as exc:  # after an answer's first words, on a line of its own
            chat.out.write(f"{exc}\n" if is_command else f"\n{exc}\n")
            chat.out.flush()


def first_model(url: str, api_key: str | None) -> str:
    """The first id of the server's /v1/models (ValueError naming the URL when it cannot answer)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise ValueError(f"--url {url}: the server could not be reached ({exc})") from None
    if response.status_code != 200:
        raise ValueError(f"--url {url}: /v1/models answered {_error_message(response.status_code, response.content)}")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"--url {url}: the server lists no model")
    return models[0]["id"]


def start_local_server(settings) -> tuple[str, Callable[[], None]]:
    """Serve the model of ``settings`` on a free loopback port from a thread of this
    process; (its URL, a function that stops it)."""
    import uvicorn

    from ember.api.server import build_engine, create_app

    app = create_app(build_engine(settings), settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="ember-chat-server", daemon=True)
    thread.start()
    lifecycle = app.state.lifecycle
    while not (server.started and lifecycle.is_ready):
        if not thread.is_alive():
            raise ValueError("the local server stopped while starting (see the log above)")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def run_chat(args: argparse.Namespace) -> int:
    from ember.api.commands import model_spec

    stop = None
    url = args.chat_url
    if url is None:
        from ember.api.settings import ServerSettings

        settings = ServerSettings(
            model_id=model_spec(args), revision=args.revision, dtype=args.dtype, engine_mode="thread",
            quantize=args.quantize, dequantize=args.dequantize, kv_cache_dtype=args.kv_cache_dtype,
            model_impl=args.model_impl, backend_options=args.backend_option,
            disabled_plugins=tuple(args.disable_plugin), required_plugins=tuple(args.plugin),
        )
        url, stop = start_local_server(settings)
    try:
        model = args.chat_model or first_model(url, args.api_key)
        params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
        params.update({k: v for k, v in (("top_k", args.top_k), ("seed", args.seed)) if v not in (None, -1)})
        chat = Chat(url, model, args.api_key, args.system, params)
        try:
            importlib.import_module("readline")  # line editing and history for input()
        except ImportError:
            pass
        print(f"ember chat: {model} at {url}; /help lists commands, Ctrl-C stops an answer, Ctrl-D leaves", flush=True)
        try:
            return repl(chat)
        finally:
            chat.close()
    finally:
        if stop is not None:
            stop()
