"""The `hf3fsctl` command line (Typer + Rich)."""
