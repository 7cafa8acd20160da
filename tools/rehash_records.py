"""
Re-hash the numerics_id of train.py run records (a results/ summary.json: a list of rows, or
{"runs": [...]}) with today's train.py, from each row's own command and device, as
tests/test_records.py recomputes them.

Only for records whose numbers today's code computes unchanged, where only the id's definition
moved (issue 45: the id hashes only what the run's recipe reads); a row another code's numbers made
moves under results/historical/ instead. Rows a GPU run wrote with an older id definition take the
same call.

    python tools/rehash_records.py results/ablation/summary.json          # rewrites the ids
    python tools/rehash_records.py --check results/ablation/summary.json  # lists them, writes none
"""
import argparse
import json
import os
import shlex
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import lora_svd  # noqa: E402
import nvfp4  # noqa: E402
import optim  # noqa: E402
import train  # noqa: E402


def command_numerics_id(command, device):
    """The numerics_id today's train.py gives `command` ("train.py --flag ...") run on `device` with
    one rank: its flags resolved as train.main resolves them (the defaults of that device), the
    contracts fresh, its --numerics applied; the contract tables are as they were afterwards."""
    argv = shlex.split(command)
    if os.path.basename(argv[0]) != "train.py":
        raise ValueError(f"not a train.py command: {command!r}")
    tables = dict(nvfp4.LINEAR), dict(optim.CONTRACT), lora_svd.BRANCH
    try:
        with mock.patch.object(torch.cuda, "is_available", lambda: device == "cuda"):
            args = train.parse_args(argv[1:])
            train.resolve_args(args, 1)
            train.fill_schedule(args)
            return train.numerics_id(train.numerics(args, 1))
    finally:
        nvfp4.LINEAR, optim.CONTRACT, lora_svd.BRANCH = dict(tables[0]), dict(tables[1]), tables[2]


def rehash(path, write=True):
    """Each row's numerics_id recomputed from its command and device; writes the file back (its
    format kept) when `write` and an id moved. Returns [(command, old id, new id)] of those moved."""
    with open(path) as f:
        text = f.read()
    record = json.loads(text)
    rows = record["runs"] if isinstance(record, dict) else record
    moved = []
    for row in rows:
        new = command_numerics_id(row["command"], row["device"])
        if new != row.get("numerics_id"):
            moved.append((row["command"], row.get("numerics_id"), new))
            row["numerics_id"] = new
    if write and moved:
        indent = 1 if text.startswith("[\n {") or text.startswith("{\n \"") else 2
        with open(path, "w") as f:
            f.write(json.dumps(record, indent=indent) + ("\n" if text.endswith("\n") else ""))
    return moved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="summary.json / runs.json records")
    p.add_argument("--check", action="store_true", help="list the ids that would move, write none")
    args = p.parse_args(argv)
    for path in args.paths:
        if not os.path.isfile(path):
            print(f"rehash_records.py: error: {path}: no such record", file=sys.stderr)
            sys.exit(2)
        moved = rehash(path, write=not args.check)
        for command, old, new in moved:
            print(f"{path}: {old} -> {new}  {command}")
        verb = "would move" if args.check else "moved"
        print(f"{path}: {len(moved)} id(s) {verb}")


if __name__ == "__main__":
    main()
