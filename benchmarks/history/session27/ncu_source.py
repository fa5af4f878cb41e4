"""Session 27: summarize Nsight Compute's per-instruction (SASS) page.

    ncu -i REP.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 benchmarks/history/session27/ncu_source.py sass.csv

Prints the column names, the warp-stall samples summed per opcode, and the instructions
with the most samples with their largest stall-reason columns. Generic on the column names
(they differ between ncu versions): a column is a sample count when its name mentions
"Sampl" or "stall".
"""
import collections
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    rows = [r for r in csv.reader(lines) if len(r) > 3]  # skip the "Kernel Name" line
    header, body = rows[0], rows[1:]
    print("columns:", header)
    src = next((i for i, h in enumerate(header) if h.strip().lower() == "source"), 1)
    counts = [i for i, h in enumerate(header)
              if (h.startswith("stall_") and "Not Issued" not in h) or "All Samples" in h]
    total_col = next((i for i in counts if "all samples" in header[i].lower()), counts[0] if counts else None)
    if total_col is None:
        print("no sample columns"); return
    print("total column:", header[total_col])
    per_op = collections.Counter()
    rows_n = []
    for r in body:
        if len(r) < len(header):
            continue
        v = number(r[total_col]) or 0.0
        op = r[src].strip().split(" ")[0] if r[src].strip() else "?"
        if op.startswith("@"):
            op = r[src].strip().split(" ")[1]
        per_op[op.split(".")[0]] += v
        rows_n.append((v, r))
    total = sum(per_op.values()) or 1.0
    print(f"\nsamples per opcode (total {total:.0f}):")
    for op, v in per_op.most_common(25):
        print(f"  {op:12s} {v:10.0f} {100 * v / total:5.1f}%")
    print("\ntop instructions:")
    for v, r in sorted(rows_n, key=lambda t: -t[0])[:40]:
        reasons = sorted(((number(r[i]) or 0.0, header[i]) for i in counts if i != total_col),
                         reverse=True)[:4]
        why = ", ".join(f"{h.replace('Warp Stall Sampling', '').strip()}={x:.0f}" for x, h in reasons if x)
        print(f"  {v:8.0f} {100 * v / total:5.1f}% | {r[0][:8]} {r[src].strip()[:70]:70s} | {why}")


if __name__ == "__main__":
    main(sys.argv[1])
