#!/usr/bin/env python3
"""The longest non-test functions in gateway/src (lines from `fn` to its
closing brace), longest first. A rough brace counter, good enough to keep
functions short: strings and chars with braces can fool it.

    scripts/longest-fns.py          # top 15
    scripts/longest-fns.py 40       # top 40
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "gateway", "src")
FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(async\s+)?(unsafe\s+)?(const\s+)?fn\s+(\w+)")


def functions(path):
    lines = open(path, encoding="utf-8").read().split("\n")
    impl = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"^\s*#\[cfg\(test\)\]", line):
            break  # tests sit at the end of each file
        m = re.match(r"^(impl(<[^>]*>)?\s+)(.*?)\s*\{?\s*$", line)
        if m:
            impl = m.group(3).split(" for ")[-1].split("<")[0].strip()
        f = FN.match(line)
        if f:
            depth, started, j = 0, False, i
            while j < len(lines):
                code = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])\'|//.*', "", lines[j])
                depth += code.count("{") - code.count("}")
                started |= "{" in code
                if (started and depth <= 0) or (not started and code.rstrip().endswith(";")):
                    break
                j += 1
            if started:
                owner = f"{impl}::" if line.startswith("    ") and impl else ""
                yield j - i + 1, f"{owner}{f.group(6)}", i + 1
            i = j + 1 if started else i + 1
            continue
        i += 1


def main():
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    found = []
    for d, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".rs"):
                p = os.path.join(d, name)
                rel = os.path.relpath(p, ROOT)
                found += [(n, fn, rel, ln) for n, fn, ln in functions(p)]
    for n, fn, rel, ln in sorted(found, reverse=True)[:top]:
        print(f"{n:5d}  {fn:40s} {rel}:{ln}")


main()
