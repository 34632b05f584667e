"""Which pooling a model's embeddings use: ``EngineConfig.pooling`` or the model's own
sentence-transformers config.

A sentence-transformers model directory lists its modules in ``modules.json``; its
``sentence_transformers.models.Pooling`` module's ``config.json`` (usually
``1_Pooling/config.json``) names the mode (``pooling_mode_lasttoken``,
``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``), and a
``sentence_transformers.models.Normalize`` module means the vectors are L2-normalised.
Without that config a decoder model pools its last token, normalised (what decoder
embedding models such as Qwen3-Embedding and E5-Mistral do). Matryoshka truncation
(``dimensions``) is allowed when ``config.json`` says ``is_matryoshka`` or lists
``matryoshka_dimensions``, or the engine's ``matryoshka`` setting says so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ember.config import EngineConfig
from ember.pooling_params import PoolingDefaults

logger = logging.getLogger(__name__)

_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"))
_ST = "sentence_transformers.models."


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sentence_transformers_pooling(model_dir: Path) -> tuple[str | None, bool | None]:
    """(pooling type, normalise) from the model's sentence-transformers config; (None, None) without one."""
    modules = _read_json(Path(model_dir) / "modules.json")
    if not isinstance(modules, list):
        return None, None
    kinds = {str(m.get("type", "")).removeprefix(_ST): str(m.get("path", "")) for m in modules if isinstance(m, dict)}
    kind = None
    if "Pooling" in kinds:
        config = _read_json(Path(model_dir) / kinds["Pooling"] / "config.json") or {}
        found = [name for key, name in _MODES if config.get(key)]
        if len(found) == 1:
            kind = found[0]
        else:
            logger.warning("sentence-transformers pooling %s is not one Ember supports (last, mean, cls): "
                           "pooling the last token", {k: v for k, v in config.items() if k.startswith("pooling_mode")})
    if "Dense" in kinds:
        logger.warning("the model's sentence-transformers Dense module is not applied: embeddings are the "
                       "pooled hidden states")
    return kind, "Normalize" in kinds


def resolve_pooling_defaults(model_dir: Path, hf_config, config: EngineConfig | None = None) -> PoolingDefaults:
    """The engine's pooling for this model (``config``'s `pooling`, `pooling_normalize`, `matryoshka`;
    None: the defaults). Pipeline parallelism runs none: the driver holds the first stage, not the
    final hidden states."""
    pooling, normalize, matryoshka = ("auto", None, None) if config is None else (
        config.pooling, config.pooling_normalize, config.matryoshka)
    st_kind, st_normalize = sentence_transformers_pooling(model_dir)
    kind = (st_kind or "last") if pooling == "auto" else pooling
    if normalize is None:
        normalize = True if st_normalize is None else st_normalize
    if matryoshka is None:
        matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or getattr(hf_config, "matryoshka_dimensions", None))
    hidden = int(getattr(hf_config, "hidden_size", 0) or 0)
    unsupported = None
    if config is not None and config.pipeline_parallel_size > 1:
        unsupported = "pooling requests (embeddings) do not run with pipeline parallelism"
    return PoolingDefaults(kind, normalize, matryoshka, hidden, unsupported)
