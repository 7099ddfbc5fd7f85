"""``posenc bench``'s report (``posenc.cli._bench_report``); the table's ratios and skips
are checked through the command in test_bench.py and test_bench_processes.py."""

from __future__ import annotations

from posenc.cli._bench_measure import Case
from posenc.cli._bench_report import format_table


def test_the_table_ends_with_the_floors_own_time_per_shape():
    """Under the rows, a line per shape and length gives the floor's time per call in
    milliseconds (the median over the rows and processes, and the range), fwd+bwd and
    forward; a run without the backward gives the one time it measured."""

    def case(scheme, shape, n, floor, forward):
        return Case(
            scheme, n, "auto", shape, {"floor": floor, "posenc": 2 * floor}, {"floor": forward}
        )

    cases = [case("alibi", "small", 64, 6e-4, 1.5e-4), case("t5", "small", 64, 7e-4, 2e-4)]
    cases.append(case("alibi", "bert", 128, 0.02, 0.005))
    table = format_table(cases).splitlines()
    assert table[-3:] == [
        "",
        "floor (plain SDPA) per call at small n=64: fwd+bwd 0.650 ms (0.600-0.700), "
        "forward 0.175 ms (0.150-0.200)",
        "floor (plain SDPA) per call at bert n=128: fwd+bwd 20.000 ms, forward 5.000 ms",
    ]  # one line a shape: over its rows, each of which timed the floor beside its scheme
    runs = [[case("alibi", "", 512, seconds, seconds / 4)] for seconds in (3e-3, 1e-3, 2e-3, 9e-3)]
    table = format_table(runs[0], runs=runs, backward=True).splitlines()
    assert table[-1] == (
        "floor (plain SDPA) per call at n=512: fwd+bwd 2.500 ms (1.000-9.000), "
        "forward 0.625 ms (0.250-2.250)"
    )
    table = format_table(runs[0], backward=False).splitlines()
    assert table[-1] == "floor (plain SDPA) per call at n=512: fwd 3.000 ms"


def test_the_copy_floor_to_the_floor_per_shape():
    """Where the copy floor was measured, a line under the floor's gives its time as a ratio
    to the floor's, over the rotary rows of the shape and length (the median and range,
    fwd+bwd and forward; one kind without the backward); none where it was not."""

    def case(scheme, floor, copies, forward, fwd_copies):
        fwd_bwd = {"floor": floor, "posenc": 2 * floor}
        fwd = {"floor": forward, "posenc": 2 * forward}
        if copies is not None:
            fwd_bwd["copy-floor"], fwd["copy-floor"] = copies, fwd_copies
        return Case(scheme, 64, "auto", "small", fwd_bwd, fwd)

    cases = [
        case("rotary", 1e-3, 1.2e-3, 2e-4, 2.6e-4),
        case("rotary-interleaved", 1e-3, 1.1e-3, 2e-4, 2.8e-4),
        case("alibi", 1e-3, None, 2e-4, None),
    ]
    table = format_table(cases).splitlines()
    assert table[-1] == (
        "copy-floor (the floor on copies of q and k) / floor at small n=64: fwd+bwd 1.15x "
        "(1.10-1.20), forward 1.35x (1.30-1.40)"
    )
    assert table[-2].startswith("floor (plain SDPA) per call at small n=64: fwd+bwd")
    assert format_table(cases, backward=False).splitlines()[-1] == (
        "copy-floor (the floor on copies of q and k) / floor at small n=64: fwd 1.15x (1.10-1.20)"
    )
    table = format_table(cases[2:]).splitlines()
    assert not any(line.startswith("copy-floor") for line in table)
