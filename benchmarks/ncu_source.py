"""Where a kernel's warps wait, per SASS instruction: Nsight Compute's source page, summed.

    ncu --clock-control none --section WarpStateStats --section SourceCounters \
        --kernel-name regex:moe_up_proj --launch-skip 1 --launch-count 1 -o /tmp/up \
        python3 benchmarks/timeline.py --run-only --out /tmp/t --shapes 7b --kernels up
    ncu -i /tmp/up.ncu-rep --page source --csv --print-source sass > up.csv
    python3 benchmarks/ncu_source.py up.csv [--listing 250]

(Set `XLA_PYTHON_CLIENT_PREALLOCATE=false` under ncu: it backs up device memory before
every replay pass. ncu holds CUPTI, so run kernels untimed: `timeline.py --run-only`.)

Prints the warp-stall samples summed per opcode, the instructions with the most samples
and their largest stall reasons, and with `--listing N` every instruction within a few of
one with more than N samples (offset from the kernel's start, samples, times executed,
SASS, top reasons): enough to tell, e.g., a consumer's wait on a `full` barrier
(`SYNCS.PHASECHK` then a branch with long-scoreboard samples) from a producer's stall on
its own address arithmetic. Session 27 found the cp.async gather's address-register stall
this way (`benchmarks/RESULTS.md`). Columns are found by name: the total is "Warp Stall
Sampling (All Samples)", the reasons the `stall_*` columns (not their "(Not Issued)" twins).
"""
import argparse
import collections
import csv


def read(path):
    """(header, rows) of ncu's `--page source --csv` output (its "Kernel Name" line skipped)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(line for line in f if line.startswith('"')) if len(r) > 3]
    return rows[0], rows[1:]


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    """The opcode of a SASS line, past any predicate (`@!P1  BRA ...` -> `BRA`)."""
    parts = source.split()
    if not parts:
        return "?"
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def summarize(header, rows, top: int = 40, listing: float = 0.0):
    """The report as lines of text."""
    src = header.index("Source")
    total_col = header.index("Warp Stall Sampling (All Samples)")
    executed = header.index("Instructions Executed") if "Instructions Executed" in header else None
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    samples = [number(r[total_col]) for r in rows]
    total = sum(samples) or 1.0
    base = int(rows[0][0], 16) if rows else 0

    def why(r):
        top_reasons = sorted(((number(r[i]), header[i][len("stall_"):]) for i in reasons),
                             reverse=True)[:3]
        return " ".join(f"{name}={v:.0f}" for v, name in top_reasons if v)

    out = [f"samples: {total:.0f}", "", "samples per opcode:"]
    per_op = collections.Counter()
    for r, v in zip(rows, samples):
        per_op[opcode(r[src]).split(".")[0]] += v
    out += [f"  {op:12s} {v:9.0f} {100 * v / total:5.1f}%" for op, v in per_op.most_common(25)]
    out += ["", "top instructions (offset, samples, share, SASS, reasons):"]
    order = sorted(range(len(rows)), key=lambda i: -samples[i])[:top]
    for i in order:
        r = rows[i]
        out.append(f"  {int(r[0], 16) - base:6x} {samples[i]:8.0f} {100 * samples[i] / total:5.1f}% "
                   f"{r[src].strip()[:64]:64s} {why(r)}")
    if listing:
        out += ["", f"listing around instructions with more than {listing:.0f} samples "
                    "(offset, samples, executed, SASS, reasons):"]
        shown = sorted({j for i, v in enumerate(samples) if v > listing
                        for j in range(max(0, i - 6), min(len(rows), i + 3))})
        previous = None
        for j in shown:
            if previous is not None and j != previous + 1:
                out.append("  ...")
            r = rows[j]
            ran = r[executed] if executed is not None else ""
            out.append(f"  {int(r[0], 16) - base:6x} {samples[j]:7.0f} {ran:>10} "
                       f"{r[src].strip()[:64]:64s} {why(r)}")
            previous = j
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", help="ncu -i REP --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=40, help="instructions to list by samples")
    ap.add_argument("--listing", type=float, default=0.0,
                    help="also list the code around instructions with more samples than this")
    args = ap.parse_args()
    print("\n".join(summarize(*read(args.csv), top=args.top, listing=args.listing)))


if __name__ == "__main__":
    main()
