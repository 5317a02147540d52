"""The command line every peer script shares (`SCRIPT SPEC.json OUT.json`); the standard library only, so each
peer environment runs it beside its script (imported by name: the script's folder is first on sys.path)."""

import json
import sys


def main(run, script: str) -> int:
    """Read the spec, `run` it, write the result; 2 with a usage line for other arguments."""
    if len(sys.argv) != 3:
        print(f"usage: {script} SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(sys.argv[1], encoding="utf-8") as spec_file:
        spec = json.load(spec_file)
    result = run(spec)
    with open(sys.argv[2], "w", encoding="utf-8") as out_file:
        json.dump(result, out_file)
    return 0
