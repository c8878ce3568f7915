"""Fuzz several targets (targets.py) one after another, each forked from one process that imported flipsync once:
`python tests/fuzz/fuzz_each.py FOLDER NAME... -- [libFuzzer flags]`. Prints one line, ``RESULT {name: exit
status}``; each target's output is FOLDER/NAME.log, its findings FOLDER/NAME/artifacts/."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make `tests.fuzz` importable

from tests.fuzz.targets import main_each

if __name__ == "__main__":
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    folder, *names = args[:cut]
    codes = main_each(names, Path(folder), args[cut + 1 :])
    print("RESULT " + json.dumps(codes), flush=True)
