"""`ep_overlap_report` on hand-written scheduled HLO in the GPU form (async start/done pairs).

The CPU mesh tests (`tests/ep_check.py --cases schedule`) see synchronous collectives only;
these modules check the positional facts the report gives on a GPU schedule."""

from pallas_moe.nn.overlap_check import entry_ops, ep_overlap_report

HEADER = """HloModule jit_step, is_scheduled=true

%fused_dot (p0: bf16[8,16], p1: bf16[16,16]) -> bf16[8,16] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,16]{1,0} parameter(1)
  ROOT %dot = bf16[8,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[8,16], w: bf16[16,16]) -> bf16[8,16] {
"""


def op(name, shape, opcode, operands, scope, extra=""):
    meta = f', metadata={{op_name="jit(step)/shard_map/{scope}"}}' if scope else ""
    args = ", ".join(f"%{o}" for o in operands)
    return f"  %{name} = {shape} {opcode}({args}){extra}{meta}\n"


def module(lines):
    return HEADER + "".join(lines) + "}\n"


BF = "bf16[8,16]{1,0}"
ASYNC = "((bf16[8,16]{1,0}), bf16[8,16]{1,0}, u32[])"  # a tuple type with nested parens


def gpu_schedule(shared_after_done=False, combine_after_next_down=False):
    lines = [
        op("x", BF, "parameter", [], "", extra="0"),
        op("w", "bf16[16,16]{1,0}", "parameter", [], "", extra="1"),
        op("dispatch-start", ASYNC, "all-to-all-start", ["x"], "ep_dispatch/ragged_all_to_all"),
    ]
    shared = op("shared", BF, "fusion", ["x", "w"], "shared_experts/dot_general",
                extra=", kind=kCustom, calls=%fused_dot")
    if not shared_after_done:
        lines.append(shared)
    lines.append(op("dispatch-done", BF, "all-to-all-done", ["dispatch-start"], "ep_dispatch/ragged_all_to_all"))
    if shared_after_done:
        lines.append(shared)
    down0 = op("down0", BF, "custom-call", ["dispatch-done", "w"], "down_proj_chunk0/mosaic",
               extra=', custom_call_target="mosaic_gpu_v2"')
    down1 = op("down1", BF, "custom-call", ["dispatch-done", "w"], "down_proj_chunk1/mosaic",
               extra=', custom_call_target="mosaic_gpu_v2"')
    start0 = op("combine0-start", ASYNC, "all-to-all-start", ["down0"], "ep_combine_chunk0/ragged_all_to_all")
    lines += [down0] + ([down1, start0] if combine_after_next_down else [start0, down1])
    lines += [
        op("combine0-done", BF, "all-to-all-done", ["combine0-start"], "ep_combine_chunk0/ragged_all_to_all"),
        op("combine1-start", ASYNC, "all-to-all-start", ["down1", "combine0-done"], "ep_combine_chunk1/ragged_all_to_all"),
        op("combine1-done", BF, "all-to-all-done", ["combine1-start"], "ep_combine_chunk1/ragged_all_to_all"),
        "  ROOT %out = bf16[8,16]{1,0} add(%combine1-done, %shared)\n",
    ]
    return module(lines)


def test_entry_ops_parse_tuple_types_and_operands():
    ops = {o.name: o for o in entry_ops(gpu_schedule())}
    assert ops["dispatch-start"].opcode == "all-to-all-start"
    assert ops["dispatch-start"].is_collective and not ops["dispatch-start"].is_done
    assert ops["combine1-start"].operands == ("down1", "combine0-done")
    assert ops["shared"].is_gemm and ops["down0"].is_gemm
    assert ops["out"].operands == ("combine1-done", "shared")


def test_report_on_an_overlapped_gpu_schedule():
    report = ep_overlap_report(gpu_schedule())
    assert report["shared"]["independent"] and report["shared"]["between_start_and_done"] is True
    assert report["num_chunks"] == 2
    (chunk,) = report["chunks"]
    assert chunk["independent"] and chunk["combine_starts_first"]


def test_report_catches_missing_overlap_in_the_schedule():
    late_shared = ep_overlap_report(gpu_schedule(shared_after_done=True))["shared"]
    assert late_shared["independent"] and late_shared["between_start_and_done"] is False
    late_combine = ep_overlap_report(gpu_schedule(combine_after_next_down=True))["chunks"][0]
    assert late_combine["independent"] and not late_combine["combine_starts_first"]
