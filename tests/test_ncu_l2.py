"""`benchmarks/ncu_l2.py`: the L2-work table from Nsight Compute's raw page, on a tiny CSV in
the layout `ncu -i REP --page raw --csv` writes (header, units row, one row per kernel)."""
import gzip

import pytest

from benchmarks.ncu_l2 import read, table, values

_HEADER = ('"Kernel Name","gpu__time_duration.sum",'
           '"l1tex__m_xbar2l1tex_read_sectors_mem_global_op_tma_ld.sum",'
           '"l1tex__m_xbar2l1tex_read_sectors_mem_lg_op_ld.sum",'
           '"lts__t_sectors_srcunit_tex_op_read.sum","dram__bytes_read.sum"\n')
_UNITS = '"","usecond","sector","sector","sector","Gbyte"\n'


def _write(path, row, opener=open):
    with opener(path, "wt") as f:
        f.write("==PROF== a line ncu prints that is not CSV\n" + _HEADER + _UNITS + row)


def test_delivered_per_served_and_units(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv.gz"
    _write(a, '"k","517.5","150,000,000","50,000,000","125,000,000","0.7"\n')
    _write(b, '"k","641.0","150,000,000","50,000,000","200,000,000","0.7"\n', gzip.open)
    va, vb = values(read(a)), values(read(b))
    assert va["delivered / served"] == pytest.approx(1.6)
    assert vb["delivered / served"] == pytest.approx(1.0)
    assert va["DRAM read"] == pytest.approx(700.0)  # Gbyte -> MB
    assert va["duration"] == pytest.approx(517.5)
    assert va["L2 read hit rate"] != va["L2 read hit rate"]  # not collected: NaN, not 0
    lines = table([read(a), read(b)], ["7b", "wide"])
    assert lines[0] == "| quantity | 7b | wide |"
    assert "| delivered / served | 1.60 | 1.00 |" in lines


def test_a_file_without_a_kernel_row_is_refused(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text(_HEADER + _UNITS)
    with pytest.raises(ValueError, match="expected a header, a units row and a kernel row"):
        read(path)
