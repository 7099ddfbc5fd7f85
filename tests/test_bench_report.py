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


def test_the_peers_ratios_again_as_a_grid_of_shapes_and_schemes():
    """Where the peer was timed, its ratios again under the table as a grid, a row per shape
    and a column per scheme: ``fwd+bwd (forward)``, the medians over the processes; empty
    where the peer was skipped; a row per length without ``--shapes``; the forward's alone
    without the backward; no grid where no peer was timed."""

    def case(scheme, shape, n, posenc, peer, fwd_posenc, fwd_peer):
        fwd_bwd = {"floor": 1.0, "posenc": posenc}
        fwd = {"floor": 1.0, "posenc": fwd_posenc}
        skipped = {}
        if peer is None:
            skipped["peer"] = "no peer for this scheme"
        else:
            fwd_bwd["peer"], fwd["peer"] = peer, fwd_peer
        return Case(scheme, n, "auto", shape, fwd_bwd, fwd, {}, skipped)

    cases = [
        case("alibi", "small", 64, 1.2, 1.0, 0.9, 1.0),
        case("cope", "small", 64, 2.0, None, 2.0, None),
        case("alibi", "bert", 128, 0.5, 1.0, 0.3, 1.0),
        case("cope", "bert", 128, 3.0, None, 3.0, None),
    ]
    table = format_table(cases).splitlines()
    start = table.index("fwd+bwd time / peer (fwd-only time / peer), a row per shape:")
    assert table[start + 1 : start + 6] == [
        "",
        "| shape | alibi | cope |",
        "|---|---:|---:|",
        "| small | 1.20 (0.90) |  |",
        "| bert | 0.50 (0.30) |  |",
    ]
    assert table[start + 6] == ""  # then the floor's own times
    assert table[start + 7].startswith("floor (plain SDPA) per call at small n=64")

    # three processes of two rows each: each cell the median of its own row's ratios
    runs = [
        [
            case("alibi", "", 512, seconds, 1.0, seconds / 2, 1.0),
            case("alibi", "", 1024, 2 * seconds, 1.0, seconds, 1.0),
        ]
        for seconds in (0.9, 1.5, 1.1)
    ]
    table = format_table(runs[0], runs=runs).splitlines()
    start = table.index(
        "fwd+bwd time / peer (fwd-only time / peer), the medians, a row per length:"
    )
    assert table[start + 2 : start + 6] == [
        "| n | alibi |",
        "|---|---:|",
        "| n=512 | 1.10 (0.55) |",
        "| n=1024 | 2.20 (1.10) |",
    ]
    table = format_table(runs[0], backward=False).splitlines()
    start = table.index("fwd time / peer, a row per length:")
    assert table[start + 4 : start + 6] == ["| n=512 | 0.90 |", "| n=1024 | 1.80 |"]

    # no grid where the peer was not in the run, nor where it was skipped for every row
    skipped_throughout = [case("cope", "small", 64, 2.0, None, 2.0, None)]
    not_asked = [case("cope", "small", 64, 2.0, None, 2.0, None)]
    not_asked[0].skipped = {}
    for cases in (skipped_throughout, not_asked):
        lines = format_table(cases).splitlines()
        assert not any(line.startswith("fwd+bwd time / peer") for line in lines)
