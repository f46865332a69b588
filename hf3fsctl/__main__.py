"""`python -m hf3fsctl` runs the CLI (the same as the `hf3fsctl` console script)."""

from hf3fsctl.cli.main import main

if __name__ == "__main__":
    main()
