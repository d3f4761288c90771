"""The engine core (scheduler, plans, requests, outputs) is plain Python: all torch work is the
worker's, so the core can be read, tested and driven (e.g. by a tensor-parallel driver)
without loading torch."""
from __future__ import annotations

import subprocess
import sys


def test_core_modules_import_without_torch():
    code = ("import sys\n"
            "import pagellm.core.scheduler, pagellm.core.plan, pagellm.core.request\n"
            "import pagellm.core.output_processor, pagellm.core.stats, pagellm.core.engine\n"
            "assert 'torch' not in sys.modules, 'pagellm.core imported torch'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
