"""Fuzz the ctx target (targets.py): `python tests/fuzz/fuzz_ctx.py -runs=N -max_total_time=S [DIR]`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make `tests.fuzz` importable

from tests.fuzz.targets import main

if __name__ == "__main__":
    main("ctx")
