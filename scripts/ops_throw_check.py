"""Device diagnostic: does a caller error raised inside the ops library reach Python?

Usage: ``python scripts/ops_throw_check.py LIBRARY {cpu|cuda}`` — loads LIBRARY, calls
gather_pages with an out-of-range column on the given device, prints the exception type.
A crash here (rc -11) means C++ exceptions cannot leave the library in this build.
"""

from __future__ import annotations

import sys

import torch

torch.ops.load_library(sys.argv[1])
device = sys.argv[2]
cache = torch.zeros(1024, dtype=torch.uint8, device=device)
out = torch.zeros(2, 64, dtype=torch.uint8, device=device)
try:
    torch.ops.hf3fsctl.gather_pages(cache, out, [0, 1], [0, 512, 32, 2, 16, 32, 1])
except (ValueError, RuntimeError) as exc:
    print(f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
