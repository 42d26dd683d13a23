"""`ksana-jax convert` in a process of its own that reports each step of its write, for
tests/test_checkpoint_writes.py (which kills it at chosen points):

    python tests/convert_worker.py SOURCE OUTPUT_DIR [--force] [--hold STEP --go FILE]

Prints `step NAME` on stdout as the write reaches each step (staging, written, swapped,
done). With --hold it stops at STEP until FILE exists (or until it is killed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's code

from checkpoints_tools import staging
from ksana_jax import cli


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("output_dir")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--hold", default=None)
    parser.add_argument("--go", default=None)
    args = parser.parse_args()

    def reached(step: str) -> None:
        print(f"step {step}", flush=True)
        if step == args.hold:
            while not Path(args.go).exists():
                time.sleep(0.02)

    staging._reached = reached
    argv = ["convert", args.source, args.output_dir] + (["--force"] if args.force else [])
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
