"""The benchmarks' trace analysis, on hand-made event lists (start ns, end ns, name):
which kernels ran side by side on different streams (`benchmarks/step.py`'s
`concurrent_kernels`), and how much of each collective the layer's kernels hid
(`benchmarks/ep.py`'s `hidden_collective_time`)."""
from benchmarks.ep import hidden_collective_time, is_collective_event
from benchmarks.step import concurrent_kernels


def test_serial_kernels_never_overlap():
    events = [(0, 10, "a"), (10, 25, "b"), (30, 40, "c")]
    assert concurrent_kernels(events) == {}


def test_overlaps_are_summed_per_pair_and_clipped_to_the_shorter_event():
    events = sorted([
        (0, 100, "moe_up_proj(x)"),  # a long kernel, its argument list dropped from the key
        (20, 30, "fusion.1"),  # wholly inside it: 10 ns
        (90, 120, "fusion.1"),  # starts inside, ends after: 10 ns more
        (95, 99, "copy"),  # inside both the up-proj and the second fusion
        (200, 210, "fusion.1"),  # alone
    ])
    overlaps = concurrent_kernels(events)
    assert overlaps == {("moe_up_proj", "fusion.1"): 20, ("moe_up_proj", "copy"): 4,
                        ("fusion.1", "copy"): 4}


def test_an_event_ending_exactly_at_a_start_is_not_running():
    assert concurrent_kernels([(0, 5, "a"), (5, 9, "b"), (5, 7, "c")]) == {("b", "c"): 2}


def test_collective_events_are_told_from_the_layers_kernels():
    for name in ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "ncclKernel_AllGather_RING_LL",
                 "ragged_all_to_all_kernel", "MemcpyP2P", "Memcpy PtoP"):
        assert is_collective_event(name), name
    for name in ("moe_up_proj", "fusion.12", "loop_reduce_fusion", "Memcpy DtoD", "cutlass_gemm"):
        assert not is_collective_event(name), name


def test_hidden_time_is_the_collectives_overlap_with_the_union_of_other_kernels():
    events = sorted([
        (0, 100, "ncclDevKernel_SendRecv"),  # the dispatch: the shared MLP hides 40 of 100 ns
        (10, 30, "shared_mlp_fusion"),
        (20, 50, "shared_mlp_fusion.2"),  # overlaps the first: counted once
        (100, 200, "moe_down_proj"),
        (150, 260, "ncclDevKernel_SendRecv"),  # a combine: 50 ns beside the down-proj, 60 exposed
        (300, 310, "ncclKernel_AllReduce"),  # nothing beside it
    ])
    assert hidden_collective_time(events) == [
        (0, 100, "ncclDevKernel_SendRecv", 40),
        (150, 110, "ncclDevKernel_SendRecv", 50),
        (300, 10, "ncclKernel_AllReduce", 0),
    ]
