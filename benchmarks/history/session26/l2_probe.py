"""Session 26 (issue 13): how fast can the SMs read a small, L2-resident table?

The SmoothQuant CSR kernel reads every (token, expert) row's f32 smooth-scale row: K * 4d
bytes per token, 1.21 GB at 7B and 4.29 GB at 30B, from a table of E * 4d bytes (0.8 / 2.1
MB) that stays in L2; that is 2.4-3.3x the bytes it must move to and from DRAM (X, Q, s).
At the measured kernel times that is ~7.4-8.2 TB/s from L2. This Triton probe (PyTorch's
device copy as the DRAM baseline) reads tables of several sizes with L1 bypassed (`.cg`)
from 4 programs per SM, 16 KB per load, and prints the achieved read bandwidth.

    python3 benchmarks/history/session26/l2_probe.py
"""
import torch
import triton
import triton.language as tl


@triton.jit
def l2_read(x_ptr, out_ptr, n_blocks, iters, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(iters):
        b = (pid + i * nprog) % n_blocks
        acc += tl.load(x_ptr + b * BLOCK + tl.arange(0, BLOCK), cache_modifier=".cg")
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block = 4096  # f32: 16 KB per load
    rows = []
    for mb in (0.8, 2.1, 8, 32, 1024):
        n = int(mb * 2**20 / 4) // block * block
        x = torch.randn(n, device="cuda")
        for per_sm in (4, 8):
            grid = sms * per_sm
            iters = max(1, int(4e9 / 4 / block / grid))  # ~4 GB read in all
            out = torch.empty(grid * block, device="cuda")
            fn = lambda: l2_read[(grid,)](x, out, n // block, iters, BLOCK=block, num_warps=8)  # noqa: E731
            ms = triton.testing.do_bench(fn, warmup=5, rep=50)
            rows.append((mb, per_sm, grid * iters * block * 4 / ms / 1e9))
    a = torch.empty(2**30 // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    copy_ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=50)
    print(f"device copy (read + write counted): {2 * 2**30 / copy_ms / 1e9:.2f} TB/s")
    print("| table MB | programs per SM | read TB/s |")
    print("|---|---|---|")
    for mb, per_sm, tbs in rows:
        print(f"| {mb} | {per_sm} | {tbs:.2f} |")


if __name__ == "__main__":
    main()
