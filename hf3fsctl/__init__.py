"""hf3fsctl: a persistent, shareable KV-cache tier for vLLM on 3FS, and its admin CLI.

The core library (`config`, `keys`, `storage`, `meta`, `staging`) imports neither vLLM
nor the CLI; heavy dependencies are imported where they are used.
"""

# The one version: pyproject.toml reads it (`dynamic = ["version"]`), so the installed
# metadata, `hf3fsctl --version` and this attribute always agree.
__version__ = "0.1.0"
