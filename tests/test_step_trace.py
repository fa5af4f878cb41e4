"""`benchmarks/step.py`'s trace analysis: which kernels ran side by side on different
streams (`concurrent_kernels`), on hand-made event lists (start ns, end ns, name)."""
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
