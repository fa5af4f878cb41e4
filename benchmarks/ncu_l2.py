"""How much L2 work a kernel's reads cost: Nsight Compute's raw metrics, side by side.

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Chart --section MemoryWorkloadAnalysis_Tables \
        --kernel-name regex:moe_up_proj --launch-skip 1 --launch-count 1 -o /tmp/a \
        python3 benchmarks/timeline.py --run-only --out /tmp/t --shapes 7b --kernels up
    ncu -i /tmp/a.ncu-rep --page raw --csv > a.csv      # (and b.csv for another run)
    python3 benchmarks/ncu_l2.py a.csv b.csv [--names 7b,7b-n1024]

(Set `XLA_PYTHON_CLIENT_PREALLOCATE=false` under ncu.) Prints, per report: the duration,
the sectors the SMs received from the L2 (TMA and LSU / cp.async, `l1tex__m_xbar2l1tex_*`),
the read sectors the L2 served them (`lts__t_sectors_srcunit_tex_op_read`), their ratio
(delivered per served: above 1 when SMs reading the same lines at the same time are served
once for several of them), the L2 hit rate, the L2 output port's busy share
(`lts__lts2xbar_cycles_active`), and the DRAM bytes. Session 30 found the up-proj's gap at
wide experts this way: the same bytes delivered and the same DRAM traffic, but 1.36x the
L2 read sectors (1.58 delivered per served at 7B, 1.16 at n = 1024;
`benchmarks/RESULTS.md`). "Same bytes per FLOP" does not mean "same L2 work".
"""
import argparse
import csv
import gzip

# (label, metric, scale, unit): the values printed, first match wins per label.
METRICS = (
    ("duration", "gpu__time_duration.sum", 1.0, "us"),
    ("delivered TMA", "l1tex__m_xbar2l1tex_read_sectors_mem_global_op_tma_ld.sum", 1e-6, "M sectors"),
    ("delivered LSU", "l1tex__m_xbar2l1tex_read_sectors_mem_lg_op_ld.sum", 1e-6, "M sectors"),
    ("L2 served (reads)", "lts__t_sectors_srcunit_tex_op_read.sum", 1e-6, "M sectors"),
    ("L2 read hit rate", "lts__t_sector_op_read_hit_rate.pct", 1.0, "%"),
    ("L2 output port busy", "lts__lts2xbar_cycles_active.avg.pct_of_peak_sustained_elapsed", 1.0, "%"),
    ("L2 throughput", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1.0, "%"),
    ("DRAM read", "dram__bytes_read.sum", None, "MB"),
    ("DRAM write", "dram__bytes_write.sum", None, "MB"),
)
_TO_MB = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
_TO_US = {"nsecond": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def read(path):
    """{metric: (unit, value)} of the first kernel in an `ncu --page raw --csv` file (or
    its gzip, as `benchmarks/history/` keeps them)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = [r for r in csv.reader(line for line in f if line.startswith('"'))]
    if len(rows) < 3:
        raise ValueError(f"{path}: expected a header, a units row and a kernel row "
                         "(`ncu -i REP --page raw --csv`)")
    return {h: (u, v) for h, u, v in zip(rows[0], rows[1], rows[2])}


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def values(report) -> dict:
    """The METRICS of one report in their printed units (NaN where ncu did not collect one),
    plus "delivered / served": the SMs' received sectors per L2 read sector."""
    out = {}
    for label, metric, scale, unit in METRICS:
        got_unit, text = report.get(metric, ("", "nan"))
        value = number(text)
        if unit == "MB":
            value *= _TO_MB.get(got_unit, float("nan"))
        elif unit == "us":
            value *= _TO_US.get(got_unit, float("nan"))
        else:
            value *= scale
        out[label] = value
    served = out["L2 served (reads)"]
    out["delivered / served"] = (out["delivered TMA"] + out["delivered LSU"]) / served if served else float("nan")
    return out


def table(reports, names) -> list[str]:
    """Markdown rows: one line per quantity, one column per report."""
    cols = [values(r) for r in reports]
    units = {label: unit for label, _, _, unit in METRICS}
    lines = ["| quantity | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label in (*units, "delivered / served"):
        unit = units.get(label, "")
        cells = " | ".join(f"{c[label]:.2f}" for c in cols)
        lines.append(f"| {label}{f' ({unit})' if unit else ''} | {cells} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="+", help="`ncu -i REP --page raw --csv` outputs")
    ap.add_argument("--names", help="comma-separated column names (default: the file names)")
    args = ap.parse_args()
    names = args.names.split(",") if args.names else args.csv
    if len(names) != len(args.csv):
        ap.error(f"--names has {len(names)} names for {len(args.csv)} files")
    print("\n".join(table([read(p) for p in args.csv], names)))


if __name__ == "__main__":
    main()
