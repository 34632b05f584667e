"""Make docs/img/playground.png: the playground in Debian's headless Chromium, driven as
tests/test_playground.py drives it (its `create_browser` and `take_screenshot`), against
a real server on the default model (SmolLM2-135M-Instruct) so that the answers read well.

    python docs/tools/playground_screenshot.py [OUTPUT.png]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from server_utils import running_server  # noqa: E402
from test_playground import create_browser, take_screenshot  # noqa: E402

from ember.weights import resolve_model  # noqa: E402


def main() -> int:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "img" / "playground.png"
    model = resolve_model(None)
    with running_server(model, engine={"num_kv_blocks": 256, "block_size": 16}, max_total_tokens=2048,
                        served_model_name="HuggingFaceTB/SmolLM2-135M-Instruct") as (url, _), \
            tempfile.TemporaryDirectory() as profile:
        driver = create_browser(Path(profile))
        try:
            take_screenshot(driver, url + "/", target)
        finally:
            driver.quit()
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
