"""The image's HEALTHCHECK: exit 0 when Ember's /health answers 200, 1 otherwise.

Python's standard library instead of curl, which the slim base does not have. The port
is the server's own (``EMBER_PORT``, default 3000); /health needs no API key.
"""

import os
import sys
import urllib.error
import urllib.request

URL = f"http://127.0.0.1:{os.environ.get('EMBER_PORT') or '3000'}/health"

try:
    with urllib.request.urlopen(URL, timeout=4) as response:
        sys.exit(0 if response.status == 200 else 1)
except (urllib.error.URLError, OSError) as exc:
    print(f"{URL}: {exc}", file=sys.stderr)
    sys.exit(1)
