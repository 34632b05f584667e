"""Conformance check for adapter kinds: does a :class:`BaseAdapterKind` keep the contract
in :mod:`ember.plugin.adapter`? Ember runs it against its own LoRA; a third party runs it
against theirs::

    from ember.testing import check_adapter_kind

    def test_my_kind_conforms(tmp_path):
        check_adapter_kind(MyKind, tmp_path)

It builds a tiny random model (``model_kind``, under ``tmp_path``) and an engine serving
adapters on it (float32, the CPU backend, batch invariant), has the kind write its
example adapter (`BaseAdapterKind.write_example`) for some of the engine's adaptable
modules, reads it back, runs its updates, and serves it through a plugin manager beside
the base model. Raises AssertionError naming the first broken rule.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ember.plugin.adapter import AdapterError, AdapterUpdate, AdapterWeights, BaseAdapterKind, read_adapter

_PLUGIN = "conformance_kind"
_ADAPTER = "example"
RANK = 8
NEW_TOKENS = 10


def _generate(engine, requests: list[tuple[str, list[int], str | None]]) -> dict[str, list[int]]:
    from ember import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for request_id, prompt, adapter in requests:
        engine.add_request(None, greedy, prompt_token_ids=prompt, request_id=request_id, adapter=adapter)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


def _check_update(kind: str, module: str, update: AdapterUpdate, shape: tuple[int, int]) -> None:
    where = f"{kind}: the update of {module!r}"
    assert isinstance(update, AdapterUpdate), f"{where} is a {type(update).__name__}, not an AdapterUpdate"
    got = (update.in_features, update.out_features)
    assert any(g is not None for g in got) and all(g is None or g == w for g, w in zip(got, shape)), (
        f"{where} maps {got[0]} -> {got[1]} features; the module maps {shape[0]} -> {shape[1]} (None: not fixed)")
    rank = update.rank
    assert isinstance(rank, int) and 0 <= rank <= RANK, f"{where} has rank {rank!r}, not in 0..max_rank {RANK}"
    factors = update.low_rank()
    if factors is None:
        assert rank == 0, f"{where}: low_rank() is None but rank is {rank} (0 for updates that are not low rank)"
        return
    assert isinstance(factors, tuple) and len(factors) == 2 and all(isinstance(t, torch.Tensor) for t in factors), (
        f"{where}: low_rank() must be None or a tuple (A, B) of tensors, got {type(factors).__name__}")
    a, b = factors
    assert rank >= 1 and tuple(a.shape) == (rank, shape[0]) and tuple(b.shape) == (shape[1], rank), (
        f"{where}: low_rank() gives A {tuple(a.shape)} and B {tuple(b.shape)}; for rank {rank} they must be "
        f"A {(rank, shape[0])} (rank, in) and B {(shape[1], rank)} (out, rank)")
    assert a.is_floating_point() and b.is_floating_point(), f"{where}: A and B must be floating point"


def _check_apply(kind: str, module: str, update: AdapterUpdate, linear, index: int, seed: int) -> None:
    """``apply`` on random rows, as the engine calls it: ``x`` the module's input rows, ``y`` its
    output rows of this part (of a fused module: the part's columns), ``linear`` the module."""
    where = f"{kind}: apply of the update of {module!r}"
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(5, linear.in_features, generator=generator)
    with torch.no_grad():
        start = sum(linear.output_sizes[:index])
        y = linear(x)[:, start : start + linear.output_sizes[index]].contiguous()
        x_before = x.clone()
        columns = (start, linear.output_sizes[index])
        first = update.apply(x, y.clone(), linear, columns=columns)
        second = update.apply(x.clone(), y.clone(), linear, columns=columns)
    assert isinstance(first, torch.Tensor), f"{where} returned {type(first).__name__}, not the output rows"
    assert first.shape == y.shape and first.dtype == y.dtype, (
        f"{where} returned {tuple(first.shape)} {first.dtype} for output rows {tuple(y.shape)} {y.dtype}")
    assert torch.equal(x, x_before), f"{where} changed its input rows x (they are the module's input: read only)"
    assert torch.equal(first, second), f"{where} is not deterministic: the same rows gave two outputs"
    assert torch.isfinite(first).all(), f"{where} gave non-finite outputs"
    factors = update.low_rank()
    if factors is not None:
        a, b = factors
        want = y + (x @ a.float().T) @ b.float().T
        assert torch.allclose(first, want, rtol=1e-4, atol=1e-4), (
            f"{where}: a low-rank update must give y + x A^T B^T; off by {(first - want).abs().max().item():.3g}")


def check_adapter_kind(kind_cls: type[BaseAdapterKind], tmp_path, *, model_kind: str = "llama") -> None:
    """Check ``kind_cls`` against the adapter-kind contract:

    - the class: a :class:`BaseAdapterKind` with a non-empty ``name`` and ``peft_types``
      a non-empty tuple of upper-case strings;
    - `write_example` for some of the model's adaptable modules (the engine's own list,
      fused parts and plain linears), read back through
      :func:`ember.plugin.adapter.read_adapter`, gives an `AdapterWeights` with one
      update for exactly those modules, each with the module's in/out features, a rank
      ``<= max_rank``, and ``low_rank()`` None (rank 0) or ``(A (rank, in), B (out, rank))``;
    - `read` itself refuses a rank above ``max_rank`` (a low-rank example read with
      ``max_rank`` one below its rank) and a missing directory, with `AdapterError`;
    - `AdapterUpdate.apply` on random rows keeps their shape and dtype, leaves ``x``
      alone, gives the same rows twice, and for a low-rank update equals
      ``y + x A^T B^T``;
    - served by an engine (the kind registered through a plugin manager, and the one the
      engine picks for its ``peft_types``): in one batch mixing the example's requests
      and the base model's (greedy, float32) each request gets the tokens it gets alone,
      and the example changes the tokens of at least one prompt.
    """
    from ember import EngineConfig
    from ember.engine.llm_engine import LLMEngine
    from ember.plugin import create_plugin_manager, hookimpl
    from ember.testing.tiny_models import make_tiny_model

    assert isinstance(kind_cls, type) and issubclass(kind_cls, BaseAdapterKind), (
        f"{kind_cls!r} is not a BaseAdapterKind subclass")
    kind = kind_cls.__name__
    assert isinstance(kind_cls.name, str) and kind_cls.name, f"{kind}.name must be a non-empty str"
    types = kind_cls.peft_types
    assert isinstance(types, tuple) and types, f"{kind}.peft_types must be a non-empty tuple, got {types!r}"
    assert all(isinstance(t, str) and t and t == t.upper() for t in types), (
        f"{kind}.peft_types must hold upper-case strings (peft's peft_type values, e.g. 'LORA'), got {types!r}")

    class _Plugin:
        @hookimpl
        def ember_register_adapter_kinds(self, registry) -> None:
            registry.register(kind_cls.name, kind_cls)

    # the entry points whose kinds would read the same peft_types (or hold the name) step aside
    installed = create_plugin_manager().registries.adapter_kinds
    disabled = {installed.owner(n) for n, k in installed.items()
                if k is not kind_cls and (n == kind_cls.name or set(k.peft_types) & set(types))}
    work = Path(tmp_path)
    model_dir = work / f"tiny-{model_kind}"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_kind, model_dir, seed=5)
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", backend="cpu", block_size=4, num_kv_blocks=128,
                     enable_lora=True, max_loras=2, max_lora_rank=RANK, backend_options={"batch_invariant": "1"}),
        create_plugin_manager(disabled=disabled, extra_plugins=[(_PLUGIN, _Plugin())]))
    registry = engine.adapters
    picked = {t: next((k for k in registry.kinds.values() if t in k.peft_types), None) for t in types}
    assert all(isinstance(k, kind_cls) for k in picked.values()), (
        f"the engine reads {types} with {[type(k).__name__ for k in picked.values()]}, not {kind}")

    # the example, for every other adaptable module (fused parts and plain linears alike)
    targets = dict(registry.targets)
    modules = {name: tuple(targets[name]) for i, name in enumerate(sorted(targets)) if i % 2 == 0}
    example = work / f"{kind_cls.name}-example"
    kind_cls().write_example(example, modules, rank=RANK, seed=7)
    assert (example / "adapter_config.json").is_file(), f"{kind}.write_example wrote no adapter_config.json"
    try:
        weights = read_adapter({_PLUGIN: kind_cls()}, _ADAPTER, example, targets=targets, max_rank=RANK)
    except AdapterError as exc:
        raise AssertionError(f"{kind}: its own example does not read back: {exc}") from exc
    assert isinstance(weights, AdapterWeights), f"{kind}.read returned {type(weights).__name__}, not AdapterWeights"
    assert weights.name == _ADAPTER, f"{kind}.read named the adapter {weights.name!r}, not {_ADAPTER!r}"
    assert set(weights.updates) == set(modules), (
        f"{kind}: the example was written for {sorted(modules)} but reads as updates of {sorted(weights.updates)}")
    for module, update in weights.updates.items():
        _check_update(kind, module, update, modules[module])

    config = json.loads((example / "adapter_config.json").read_text())
    top = max(u.rank for u in weights.updates.values())
    if top > 0:
        try:
            kind_cls().read(_ADAPTER, example, config, max_rank=top - 1)
        except AdapterError:
            pass
        else:
            raise AssertionError(f"{kind}.read accepted rank {top} with max_rank {top - 1} (AdapterError expected)")
    try:
        kind_cls().read(_ADAPTER, work / "no-such-adapter", config, max_rank=RANK)
    except AdapterError:
        pass
    except Exception as exc:  # noqa: BLE001 - the rule is about which error
        raise AssertionError(f"{kind}.read of a missing directory raised {exc!r}, not AdapterError") from exc
    else:
        raise AssertionError(f"{kind}.read of a missing directory returned instead of raising AdapterError")

    parts = engine.core.model.linear_parts()
    for i, (module, update) in enumerate(sorted(weights.updates.items())):
        linear, index = parts[module]
        _check_apply(kind, module, update, linear, index, seed=100 + i)

    # served: the example's requests beside the base model's, each as alone
    engine.add_adapter(_ADAPTER, str(example))
    gen = torch.Generator().manual_seed(11)
    vocab = engine.model_info.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (3, 9, 17, 6)]
    requests = [(f"{who}-{i}", p, adapter) for i, p in enumerate(prompts)
                for who, adapter in (("adapter", _ADAPTER), ("base", None))]
    together = _generate(engine, requests)
    for request_id, prompt, adapter in requests:
        alone = _generate(engine, [(f"alone-{request_id}", prompt, adapter)])[f"alone-{request_id}"]
        assert together[request_id] == alone, (
            f"{kind}: request {request_id!r} ({'the example' if adapter else 'the base model'}) gave "
            f"{together[request_id]} in a batch mixing the example and the base model but {alone} alone")
    assert any(together[f"adapter-{i}"] != together[f"base-{i}"] for i in range(len(prompts))), (
        f"{kind}: the example adapter changes no prompt's greedy tokens (make write_example's weights larger)")
