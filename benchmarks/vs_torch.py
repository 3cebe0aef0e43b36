"""zeropipe vs torch.distributed.pipelining on the same model, side by side.

    python benchmarks/vs_torch.py            # the table
    python benchmarks/vs_torch.py --json     # one JSON object per schedule per line

Same as ``zeropipe bench``; see zeropipe/apps/bench.py for what is measured.
"""

from __future__ import annotations

import sys

from zeropipe.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
