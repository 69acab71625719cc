"""Whether two commits build the same sm_90 kernels: compares two SM90_SASS_LOG files (tests/sm90.py), written by
the tests' ahead-of-time builds at each commit (no GPU needed).

    SM90_SASS_LOG=/tmp/before.log python -m pytest -q tests -k sm90     # at the old commit
    SM90_SASS_LOG=/tmp/after.log python -m pytest -q tests -k sm90      # at the new one
    python tools/compare_sass.py /tmp/before.log /tmp/after.log

Prints each build whose SASS differs or that only one side has, and exits 1 if there is any.
"""
import sys
from collections import Counter


def read(path):
    """Counter of (tool, what was built, kernel, digest) lines: a build the tests make twice counts twice."""
    with open(path) as f:
        return Counter(tuple(line.split()) for line in f if line.strip())


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.exit("usage: python tools/compare_sass.py BEFORE.log AFTER.log")
    before, after = map(read, argv)
    gone, new = before - after, after - before
    for label, lines in (("only before", gone), ("only after", new)):
        for line in sorted(lines):
            print(f"{label}: {' '.join(line)}")
    print(f"{sum(before.values())} builds before, {sum(after.values())} after, "
          f"{sum((before & after).values())} identical")
    return 1 if gone or new else 0


if __name__ == "__main__":
    sys.exit(main())
