"""Split the engine's step time into model forward and everything else (prints JSON).

    python benchmarks/engine_step.py                      # small Llama, bfloat16, 1/32/128/256
    python benchmarks/engine_step.py --dtype float32 --batch-sizes 1,32

The same as ``pagellm bench engine``; see pagellm/bench/engine_step.py for what is timed.
Target: everything but the model forward under 5% of the step at 256 running sequences.
"""
from __future__ import annotations

import sys

from pagellm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "engine", *sys.argv[1:]]))
