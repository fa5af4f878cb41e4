"""`benchmarks/ncu_source.py`: Nsight Compute's per-instruction page summed, on a tiny CSV in
the layout ncu 2025.3 writes (a "Kernel Name" line, then the header and one row per SASS
instruction)."""

from benchmarks.ncu_source import opcode, read, summarize

_CSV = '''"Kernel Name","moe_up_proj_mosaic_gpu_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x7f0000000000","      SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR11], R8","10","100","2","8","2"
"0x7f0000000010","      @!P1  BRA 0x7f0000000100","300","100","290","10","290"
"0x7f0000000020","      IMAD.WIDE.U32 R4, R21, 0xc00, R2","90","1,000","85","5","85"
"0x7f0000000030","      LDGSTS.E.BYPASS.128 desc[UR6][R4.64], [R20]","0","1,000","0","0","0"
'''


def test_summary_names_the_hot_instructions_and_their_reasons(tmp_path):
    path = tmp_path / "sass.csv"
    path.write_text(_CSV)
    header, rows = read(path)
    assert header[0] == "Address" and len(rows) == 4
    assert opcode(rows[1][1].strip()) == "BRA" and opcode("") == "?"
    lines = summarize(header, rows, top=2, listing=200)
    text = "\n".join(lines)
    assert lines[0] == "samples: 400"
    assert "BRA" in lines[3] and "75.0%" in lines[3]  # 300 of 400 samples, listed first
    top = [line for line in lines if "@!P1  BRA" in line][0]
    assert top.split()[0] == "10" and "long_sb=290 wait=10" in top  # offset from the start
    assert "long_sb (Not Issued)" not in text  # the Not-Issued twins are not reasons
    listing = lines[lines.index(next(l for l in lines if l.startswith("listing"))) + 1:]
    assert [line.split()[0] for line in listing] == ["0", "10", "20", "30"]
    assert "1,000" in listing[2]  # executed counts as ncu prints them
