"""The engine beside an asyncio event loop: the `EngineClient` the API uses.

`AsyncLLMEngine` keeps the request's two ends in the caller's process — validation
(`ember.engine.input_processor`, in the caller's thread) and the output processor
(detokenization, stop strings, n/best_of) — and runs the engine core either in a
thread of this process (``AsyncLLMEngine(engine)``) or in a process of its own
(``AsyncLLMEngine.with_engine_process(config)``, `ember.engine.core_process.EngineCoreProcess`). Either way
only values cross to the core (`EngineCoreRequest`, abort ids) and back
(`EngineCoreOutputs`), and the event loop (HTTP) never waits on a forward pass.
Outputs reach each request through its own asyncio queue. A failing step fails the
requests it held, never the loop: the engine keeps serving the next requests.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from ember.config import EngineConfig
from ember.engine.adapters import apply_adapter_command, check_adapter_name, resolve_adapter_path
from ember.engine.client import (
    AdapterInfo,
    EngineClient,
    EngineDeadError,
    EngineFatalError,
    EngineStats,
    ModelInfo,
    RequestAbortedError,
)
from ember.engine.core import EngineCore, EngineCoreOutputs, EngineCoreRequest
from ember.engine.core_process import CoreProcessReader, EngineCoreProcess
from ember.engine.input_processor import InputProcessor, apply_chat_template
from ember.engine.llm_engine import LLMEngine
from ember.engine.output_processor import OutputKind, OutputProcessor
from ember.engine.supervisor import CoreSupervisor, RestartPolicy
from ember.models.tokenizer import encode_with_offsets, load_tokenizer
from ember.outputs import RequestOutput
from ember.plugin import create_plugin_manager
from ember.plugin.adapter import AdapterError, AdapterWeights, UnknownAdapterError, read_adapter
from ember.plugin.logits_processor import BaseLogitsProcessor, LogitsProcessorContext
from ember.sampling_params import SamplingParams
from ember.sched.request import RequestStatus
from ember.sched.step import StepStats
from ember.worker.logits_pipeline import LogitsPipeline
from ember.worker.sampler import Sampler

logger = logging.getLogger(__name__)


__all__ = ["AsyncLLMEngine", "EngineDeadError", "RequestAbortedError"]


@dataclass(frozen=True, slots=True)
class _AdapterCommand:  # load ("add": weights read and checked on this side) or unload ("remove") an adapter
    action: str
    name: str
    path: str = ""
    weights: AdapterWeights | None = None


@dataclass(frozen=True, slots=True)
class _Abort:
    request_ids: list[str]
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


class _RequestStream:
    """Outputs of one request, pushed from the engine thread into the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass


def _put_all(items: list[tuple[_RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


def _deliver(items: list[tuple[_RequestStream, RequestOutput]]) -> None:
    """Hand one step's outputs to their event loops: one wake-up per loop, not one
    per request (64 streams would otherwise wake the HTTP loop 64 times a step)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, out in items:
        by_loop.setdefault(stream.loop, []).append((stream, out))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass


class AsyncLLMEngine(CoreProcessReader, EngineClient):
    """``AsyncLLMEngine(engine)``: the engine's core steps in a thread of this process.
    :meth:`with_engine_process`: the core in its own process."""

    def __init__(self, engine: LLMEngine | None = None, *, _process=None, _plugin_manager=None,
                 _supervisor: CoreSupervisor | None = None) -> None:
        if (engine is None) == (_process is None):
            raise ValueError("give an LLMEngine (or use AsyncLLMEngine.with_engine_process)")
        self._core: EngineCore | None = engine.core if engine is not None else None
        self._process = _process
        if engine is not None:
            self.engine = engine
            self.tokenizer = engine.tokenizer
            self._model_info = engine.model_info
            self._pipeline = engine.core.logits_pipeline
            self._plugin_manager = engine.core.plugin_manager
            self.input_processor = engine.input_processor
            self._stats = engine.core.stats()
        else:
            info: ModelInfo = _process.model_info
            self._model_info = info
            self.tokenizer = load_tokenizer(info.model_dir)
            self._plugin_manager = _plugin_manager
            config: EngineConfig = _process.config
            # the front's own processor instances: request validation and plugin
            # routes (the watermark's /detect) use them; the core has its own
            self._pipeline = LogitsPipeline.from_registry(
                _plugin_manager.registries.logits_processors,
                LogitsProcessorContext(info.vocab_size, info.eos_token_ids, self.tokenizer),
                config.processor_options,
            )
            validator = Sampler(info.vocab_size, pipeline=self._pipeline)
            self.input_processor = InputProcessor(self.tokenizer, info, validator.validate)
            self._stats = EngineStats(0, 0, info.num_kv_blocks, info.num_kv_blocks, 0, 0, 0)
        self.output_processor = OutputProcessor(self.tokenizer)
        # the adapters the core serves, as this side knows them (every load and unload passes here)
        lora = self._model_info.lora
        self._adapters: dict[str, AdapterInfo] = {a.name: a for a in lora.adapters} if lora is not None else {}
        # guards the output processor, _streams and the id counter: callers add and
        # abort from the event loop, the engine thread processes outputs
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue[EngineCoreRequest | _Abort] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _RequestStream] = {}
        self._next_id = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead_error: BaseException | None = None
        self._supervisor = _supervisor  # restarts a dead core process (--restart-engine-on-failure), or None
        self._restart_cause: BaseException | None = None  # set while a restarted core loads
        self.num_steps = 0
        # called in the engine thread after every step that computed tokens; must be quick
        self._step_listeners: list[Callable[[StepStats], None]] = []

    @classmethod
    def with_engine_process(cls, config: EngineConfig, plugin_manager=None,
                            restart_policy: RestartPolicy | None = None) -> AsyncLLMEngine:
        """Start the engine core in its own process (loading the model there) and
        return the client for it. Plugins load from the ``ember`` entry points in both
        processes; ``plugin_manager`` (else one made from ``config``) serves this side.
        ``restart_policy``: a core that dies is replaced in place (`ember.engine.supervisor`)."""
        pm = plugin_manager or create_plugin_manager(disabled=config.disabled_plugins, required=config.required_plugins)
        process = EngineCoreProcess(config)
        process.config = config
        supervisor = CoreSupervisor(config, restart_policy) if restart_policy is not None else None
        return cls(_process=process, _plugin_manager=pm, _supervisor=supervisor)

    # -- lifecycle ------------------------------------------------------------
    @property
    def engine_mode(self) -> str:
        return "process" if self._process is not None else "thread"

    def start(self) -> None:
        if self._thread is None:
            target = self._run_thread if self._process is None else self._run_reader
            self._thread = threading.Thread(target=target, name="ember-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._process is not None:
            self._process.close(timeout)
        elif self._core is not None:
            self._core.close()  # parallel workers, if any

    @property
    def is_running(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return alive and self._dead_error is None and self._restart_cause is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    @property
    def restart_cause(self) -> BaseException | None:
        return self._restart_cause

    @property
    def num_restarts(self) -> int:
        return self._supervisor.num_restarts if self._supervisor is not None else 0

    # -- requests -------------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        with self._lock:
            self._next_id += 1
            return f"{prefix}-{self._next_id}"

    def validate(self, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None = None) -> list[int]:
        """Tokenize and check a request without queueing it; ValueError names the problem."""
        return self.input_processor.validate(prompt, params, prompt_token_ids)

    async def generate(
        self,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        *,
        validated: bool = False,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        adapter: str | None = None,
        mm_items: tuple = (),
    ) -> AsyncIterator[RequestOutput]:
        """Validate (unless ``validated``: the caller checked exactly these ids and
        params with :meth:`validate`), queue and stream one request's outputs (the last
        has ``finished``). ``priority``: lower is scheduled first. ``output_kind``:
        DELTA outputs carry only what each step added.

        Leaving the iterator early (client gone, task cancelled) aborts the request,
        which frees its KV blocks at the engine's next step. ``adapter``: a served
        adapter's name (`UnknownAdapterError` for another). ``mm_items``: the prompt's
        images, processed (`ember.multimodal.processor`; the ids already expanded).
        """
        if not self.is_running:
            if (cause := self._restart_cause) is not None:
                raise EngineDeadError(f"the engine core is restarting after it died ({cause}); retry in a few seconds")
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")
        if adapter is not None and adapter not in self._adapters:
            raise UnknownAdapterError(f"adapter {adapter!r} is not loaded; loaded adapters: "
                                      f"{', '.join(self._adapters) or 'none'}")
        if validated and prompt_token_ids is not None:
            ids = list(prompt_token_ids)
        else:
            ids = self.input_processor.validate(prompt, params, prompt_token_ids, priority)
        request_id = request_id or self.new_request_id()
        stream = _RequestStream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self.output_processor.add_request(request_id, prompt, ids, params, output_kind)
        self._send(EngineCoreRequest(request_id, ids, params, priority, adapter, mm_items=tuple(mm_items)))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        with self._lock:
            ids = self.output_processor.abort(request_id)
        self._send(_Abort([request_id, *ids]))

    # -- adapters ---------------------------------------------------------------
    def adapters(self) -> dict[str, AdapterInfo]:
        return dict(self._adapters)

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Read and check the adapter here (its errors reach the caller at once), then
        hand it to the core: requests sent after this call may use it."""
        if (lora := self._model_info.lora) is None:
            raise AdapterError(f"adapter {name!r}: LoRA adapters are off (start with --enable-lora or --lora-modules)")
        check_adapter_name(name)
        if name in self._adapters:
            raise AdapterError(f"adapter {name!r} is already loaded; unload it first or choose another name")
        kinds = {k: cls() for k, cls in self._plugin_manager.registries.adapter_kinds.items()}
        weights = read_adapter(kinds, name, resolve_adapter_path(name, path), targets=lora.targets,
                               max_rank=lora.max_lora_rank)
        self._adapters[name] = info = AdapterInfo(name, path, weights.kind, weights.max_rank)
        self._send(_AdapterCommand("add", name, path, weights))
        return info

    def unload_adapter(self, name: str) -> None:
        if self._adapters.pop(name, None) is None:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded; loaded adapters: "
                                      f"{', '.join(self._adapters) or 'none'}")
        self._send(_AdapterCommand("remove", name))

    def _send(self, command: EngineCoreRequest | _Abort | _AdapterCommand) -> None:
        if self._process is None:
            self._commands.put(command)
            self._wakeup.set()
            return
        try:
            if isinstance(command, _Abort):
                self._process.abort(command.request_ids, command.status)
            elif isinstance(command, _AdapterCommand):
                self._process.adapter(command.action, command.name, command.path, command.weights)
            else:
                self._process.add(command)
        except (OSError, ValueError) as exc:  # the pipe is closed: the core is gone
            if isinstance(command, EngineCoreRequest):  # (the reader ends the others, or restarts the core)
                self._fail([command.request_id], EngineDeadError(f"the engine-core process is gone: {exc!r}"))
            if self._supervisor is None:
                self._die(exc)

    def abort_all(self, reason: str) -> int:
        """End every request in flight with `RequestAbortedError(reason)` (its caller sees
        the error, never a silent end) and free its blocks; return how many there were."""
        with self._lock:
            request_ids = list(self._streams)
            streams = list(self._streams.values())
        for request_id, stream in zip(request_ids, streams):
            stream.put(RequestAbortedError(reason))
            self.abort(request_id)
        return len(request_ids)

    @property
    def num_requests(self) -> int:
        """Requests queued or running (those whose caller still waits for outputs)."""
        return len(self._streams)

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call ``listener(stats)`` in the engine thread after each step that computed
        tokens. A listener that raises is logged, never stops the loop."""
        self._step_listeners.append(listener)

    # -- the tokenizer (called from any thread: the engine thread never changes it) --------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_with_offsets(self, text: str, keep_last: int) -> tuple[int, list[int], list[tuple[int, int]]]:
        return encode_with_offsets(self.tokenizer, text, keep_last)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return apply_chat_template(self.tokenizer, messages, tools)

    @property
    def chat_template(self) -> str | None:
        template = self.tokenizer.chat_template
        return template if isinstance(template, str) else None

    # -- facts and counts ---------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    def stats(self) -> EngineStats:
        """The counts after the latest step (a value the core sent with it)."""
        return self._stats

    def logits_processor(self, name: str) -> BaseLogitsProcessor:
        for processor in self._pipeline.processors:
            if processor.name == name:
                return processor
        raise LookupError(f"the logits processor {name!r} is not loaded")

    @property
    def plugin_manager(self):
        return self._plugin_manager

    # -- the engine thread: the core in this process -------------------------------------
    def _run_thread(self) -> None:
        with torch.inference_mode():  # for good in the engine's thread (the runner then only checks)
            self._run_steps()

    def _run_steps(self) -> None:
        core = self._core
        try:
            while not self._stop.is_set():
                self._drain_commands(core)
                if not core.has_unfinished_requests():
                    if core.fatal_error is not None:  # a parallel worker died while idle
                        raise EngineFatalError(core.fatal_error)
                    self._stats = core.stats()
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
                    continue
                try:
                    outputs = core.step()
                except EngineFatalError:
                    raise
                except Exception as exc:
                    # Fail the requests in flight, keep the loop alive for the next ones.
                    logger.exception("engine step failed; aborting the %d request(s) in flight", len(self._streams))
                    ids = list(core.scheduler.requests)
                    core.abort_all()
                    self._fail(ids, RuntimeError(f"engine step failed: {exc!r}"))
                    continue
                self._handle(outputs)
        except EngineFatalError as exc:
            logger.error("engine stops: %s", exc)
            core.close()
            self._die(EngineDeadError(f"engine stopped: {exc}"))
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            logger.exception("engine loop died")
            self._die(exc)

    def _drain_commands(self, core: EngineCore) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                core.abort_requests(command.request_ids, command.status)
                continue
            if isinstance(command, _AdapterCommand):
                apply_adapter_command(core, command.action, command.name, command.path, command.weights)
                continue
            if command.request_id not in self._streams:  # the client left before the request reached the engine
                continue
            try:
                core.add_request(command)
            except ValueError as exc:
                self._fail([command.request_id], exc)

    # -- both ----------------------------------------------------------------------------
    def _handle(self, core_outputs: EngineCoreOutputs) -> None:
        self.num_steps += 1
        if core_outputs.stats is not None:
            self._stats = core_outputs.stats
        with self._lock:
            outputs, stopped = self.output_processor.process(core_outputs.outputs)
        if stopped:
            self._send(_Abort(stopped, RequestStatus.FINISHED_STOPPED))
        streams = self._streams
        _deliver([(stream, out) for out in outputs if (stream := streams.get(out.request_id)) is not None])
        stats = core_outputs.step_stats
        if stats is not None and stats.kind != "empty":
            for listener in self._step_listeners:
                try:
                    listener(stats)
                except Exception:
                    logger.exception("step listener %r failed", listener)

    def _fail(self, core_ids: list[str], exc: BaseException) -> None:
        """End the callers of these core requests (children map to their parent) with ``exc``."""
        with self._lock:
            ids = {self.output_processor.caller_id(rid) for rid in core_ids}
            for rid in ids:
                self.output_processor.abort(rid)
            streams = [self._streams[rid] for rid in ids if rid in self._streams]
        for stream in streams:
            stream.put(exc)

    def _die(self, exc: BaseException) -> None:
        if self._dead_error is None:
            self._dead_error = exc
        with self._lock:
            streams = list(self._streams.values())
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine loop died: {exc!r}")
        for stream in streams:
            stream.put(error)

