"""The compiled staging ops: C++/CUDA sources (`csrc/`, shipped as package data) and their builder.

`hf3fsctl.ops.build` compiles them against the running interpreter's torch; nothing here
runs at import time. `hf3fsctl.staging` loads the result. See docs/staging-ops.md.
"""
