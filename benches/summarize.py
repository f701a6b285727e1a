#!/usr/bin/env python3
"""Medians of benches/ab.sh result directories as markdown tables.

  benches/summarize.py DIR            the table ab.sh prints for one run
  benches/summarize.py DIR DIR ...    one table for several runs (what `make bench` prints):
                                      a row per model, protocol and concurrency, plus RSS

A = the baseline (Triton in benches/side_by_side.sh), B = the candidate (wasmtron).
"""
import csv
import glob
import os
import statistics
import sys


def number(v):
    return f"{v:.2f}" if v < 10 else f"{v:.0f}"


def load(out):
    meta = {}
    if os.path.exists(f"{out}/meta"):
        with open(f"{out}/meta") as f:
            meta = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
    levels = meta.get("concurrency", "").split() or sorted(
        {p.split("-c")[1].split("-")[0] for p in glob.glob(f"{out}/A-c*-r*.csv")}, key=int)
    rows = {}
    for c in levels:
        for side in "AB":
            got = []
            for path in sorted(glob.glob(f"{out}/{side}-c{c}-r*.csv")):
                with open(path) as f:
                    for row in csv.DictReader(f):
                        got.append([float(row[k]) for k in
                                    ("Inferences/Second", "p50 latency", "p99 latency")])
            if got:
                rows[(c, side)] = [statistics.median(x[i] for x in got) for i in range(3)]
    rss = None
    if os.path.exists(f"{out}/rss-kib"):
        rss = [int(v) for v in open(f"{out}/rss-kib").read().split()]
    return meta, levels, rows, rss


def one(out):
    meta, levels, rows, rss = load(out)
    print(f"results in {out}\n")
    print("| concurrency | A infer/s | B infer/s | B/A | A p50 µs | B p50 µs | A p99 µs | B p99 µs |")
    print("|---|---|---|---|---|---|---|---|")
    for c in levels:
        a, b = rows.get((c, "A")), rows.get((c, "B"))
        if not a or not b:
            print(f"| {c} | (no data) |")
            continue
        print(f"| {c} | {number(a[0])} | {number(b[0])} | {b[0] / a[0]:.2f} | "
              f"{a[1]:.0f} | {b[1]:.0f} | {a[2]:.0f} | {b[2]:.0f} |")
    if rss:
        print(f"\nserver RSS after the load (with child processes): A {rss[0] / 1024:.0f} MiB, "
              f"B {rss[1] / 1024:.0f} MiB, B/A {rss[1] / max(rss[0], 1):.2f}")


def many(outs):
    print("| model | protocol | c | A infer/s | B infer/s | B/A | A p50 µs | B p50 µs | p50 B/A "
          "| A p99 µs | B p99 µs | RSS A MiB | RSS B MiB | RSS B/A |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for out in outs:
        meta, levels, rows, rss = load(out)
        model, protocol = meta.get("model", os.path.basename(out)), meta.get("protocol", "?")
        for c in levels:
            a, b = rows.get((c, "A")), rows.get((c, "B"))
            if not a or not b:
                print(f"| {model} | {protocol} | {c} | (no data) |")
                continue
            memory = (f"{rss[0] / 1024:.0f} | {rss[1] / 1024:.0f} | {rss[1] / max(rss[0], 1):.2f}"
                      if rss else " | | ")
            print(f"| {model} | {protocol} | {c} | {number(a[0])} | {number(b[0])} | "
                  f"{b[0] / a[0]:.2f} | {a[1]:.0f} | {b[1]:.0f} | {b[1] / a[1]:.2f} | "
                  f"{a[2]:.0f} | {b[2]:.0f} | {memory} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    one(sys.argv[1]) if len(sys.argv) == 2 else many(sys.argv[1:])
