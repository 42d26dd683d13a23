"""`python -m checkpoints_tools SOURCE OUTPUT_DIR [--dtype ...] [--force]`."""

import sys

from ksana_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
