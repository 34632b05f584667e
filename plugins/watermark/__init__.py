"""The watermark plugin (entry point ``watermark``): Kirchenbauer et al. (2023).

- :mod:`.green_list`: the keyed green list (the hash is documented there);
- :mod:`.processor`: ``WatermarkProcessor``, the logits processor ``"watermark"``;
- :mod:`.detector`: ``Detector``, green count, z-score and p-value;
- :mod:`.routes`: ``POST /watermark/detect``, added through ``ember_api_routes``.

See docs/watermark.md.
"""

from __future__ import annotations

from ember.plugin import Registry, hookimpl

from .detector import DetectionOutput, Detector
from .green_list import DEFAULT_DELTA, DEFAULT_GAMMA, DEFAULT_KEY, GreenList, WatermarkSettings
from .processor import WatermarkProcessor

__all__ = [
    "DEFAULT_DELTA", "DEFAULT_GAMMA", "DEFAULT_KEY", "DetectionOutput", "Detector", "GreenList",
    "WatermarkProcessor", "WatermarkSettings",
]


@hookimpl
def ember_register_logits_processors(registry: Registry) -> None:
    registry.register(WatermarkProcessor.name, WatermarkProcessor)


@hookimpl
def ember_api_routes(context):
    from .routes import WatermarkRoutes  # pydantic only when the HTTP app is built

    return WatermarkRoutes(context).routes()
