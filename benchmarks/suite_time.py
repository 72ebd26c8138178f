"""The test suite's time, from pytest's own output: the figures README.md and docs/benchmarks.md give are generated
here from a run's log, never typed.

    .ci/run 2>&1 | tee ci.log                       # (or: python -m pytest -q 2>&1 | tee ci.log)
    python benchmarks/suite_time.py ci.log [more.log ...] [--write]

Prints, per log, the tests passed/skipped/failed and the wall time pytest reports, and the slowest tests of the
first log (pytest's ``--durations`` table, which the project's pytest settings print). ``--write`` puts the same
into docs/benchmarks.md (the section between its ``suite-time`` markers: the date, the host's CPU count, each run,
the slowest tests) and the sentence of README.md's Tests section between its markers.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^=* ?(?P<counts>(?:\d+ \w+, )*\d+ \w+) in (?P<seconds>[\d.]+)s(?: \((?P<clock>[\d:]+)\))?(?: =+)?$")
DURATION = re.compile(r"^(?P<seconds>[\d.]+)s (?P<phase>call|setup|teardown) +(?P<test>\S+)$")
MARKERS = {"docs": ("<!-- suite-time: begin -->", "<!-- suite-time: end -->"),
           "readme": ("<!-- suite-time: begin -->", "<!-- suite-time: end -->")}


def read_log(path) -> dict:
    """{"counts": {"passed": n, ...}, "seconds": total, "slowest": [(seconds, phase, test)]} of a pytest log."""
    counts, seconds, slowest = None, None, []
    for line in Path(path).read_text(errors="replace").splitlines():
        line = line.strip()
        match = SUMMARY.match(line)
        if match:
            counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", match["counts"])}
            seconds = float(match["seconds"])
        match = DURATION.match(line)
        if match:
            slowest.append((float(match["seconds"]), match["phase"], match["test"]))
    if counts is None:
        raise SystemExit(f"{path}: no pytest summary line (did the run finish?)")
    return {"counts": counts, "seconds": seconds, "slowest": slowest}


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(round(seconds % 60))} s"


def describe(run: dict) -> str:
    counts = ", ".join(f"{n} {word}" for word, n in run["counts"].items())
    return f"{counts} in {minutes(run['seconds'])}"


def replace_between(path: Path, markers, text: str) -> None:
    content = path.read_text()
    begin, end = markers
    if begin not in content or end not in content:
        raise SystemExit(f"{path}: no {begin} ... {end} markers")
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="pytest logs of whole runs, oldest first (the last one's count and slowest tests listed)")
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks.md's and README.md's figures")
    parser.add_argument("--slowest", type=int, default=25)
    parser.add_argument("--note", default="", help="a few words on the runs (the host, what else ran)")
    args = parser.parse_args(argv)
    runs = [read_log(path) for path in args.logs]
    today = datetime.date.today().isoformat()
    cores = os.cpu_count()
    lines = [f"Measured {today} on a {cores}-core host ({len(runs)} run(s) of `.ci/run`'s tests"
             + (f"; {args.note}" if args.note else "") + "):", ""]
    lines += [f"- run {k + 1}: {describe(run)}" for k, run in enumerate(runs)]
    lines += ["", f"The {args.slowest} slowest of run {len(runs)} (pytest `--durations`):", "", "```"]
    lines += [f"{seconds:8.2f}s {phase:8s} {test}" for seconds, phase, test in runs[-1]["slowest"][:args.slowest]]
    lines += ["```"]
    text = "\n".join(lines)
    print(text)
    sentence = (f"{runs[-1]['counts'].get('passed', 0)} tests passed in " + " and ".join(
        minutes(run["seconds"]) for run in runs) + f" on {cores} cores ({today}, {len(runs)} run(s) on a clean clone; "
        "times and the slowest tests: docs/benchmarks.md).")
    print("\nREADME: " + sentence)
    if args.write:
        replace_between(ROOT / "docs" / "benchmarks.md", MARKERS["docs"], text)
        replace_between(ROOT / "README.md", MARKERS["readme"], sentence)


if __name__ == "__main__":
    main()
