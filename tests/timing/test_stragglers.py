"""Injected slowness is found: 2 gloo EP ranks, rank 1's expert compute delayed by ``DELAY_S``.

One spawn (the ``ep_run`` fixture in conftest.py); each rank runs the reference EP model in both
exchange modes three times on the same inputs: with timing off, with timing on the machine's clock
(rank 1 sleeping ``DELAY_S`` in every layer's ``expert`` phase), and with timing on the counting
clock of tests/phase_ticks.py (rank 1's delay moves the counter instead). The stat-mode dumps
(gathered over both ranks) are analysed here.

Which rank is slowest, how long the other waits and how much of a layer its phases cover are, on
the machine's clock, the scheduler's business (under load it can hold rank 0 longer than rank 1
sleeps): those figures are printed, never bounded. What is asserted on the machine's clock cannot
fail by chance (a phase holds the sleeps inside it; phases never exceed their layer); the rest is
asserted exactly on the counting clock, where a phase lasts its readings and its injected delays.
"""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.analysis.timing import analyze_timing
from moetrace.timing import PHASES
from moetrace.trace.reader import open_trace

from ..phase_ticks import TICK_S
from .conftest import DELAY_S, LAYERS, PASSES, RUNS

EXPERT = PHASES.index("expert")


def _grid(rows: dict[str, np.ndarray]) -> np.ndarray:
    """``[N, R, L, P]`` phase seconds of the trace's ``/timing`` rows, by pass, rank and layer."""
    pass_ids = np.unique(rows["pass_id"])
    phase = np.zeros((len(pass_ids), 2, LAYERS, rows["phase"].shape[-1]))
    phase[np.searchsorted(pass_ids, rows["pass_id"]), rows["rank"].astype(np.int64)] = np.nan_to_num(rows["phase"])
    return phase


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_injected_slow_rank_is_named_and_its_wait_measured(ep_run, mode):
    """Every straggler figure ``analyze`` gives equals the same figure counted here from the trace's
    own ``/timing`` rows, on both clocks. On the counting clock, rank 1's expert phase is rank 0's
    plus the delay in every (pass, layer): rank 1 is the slowest in every pass, and rank 0 waits the
    delay in every layer. On the machine's clock, rank 1's expert phase holds every sleep the harness
    timed around it (``time.sleep`` sleeps at least ``DELAY_S``); the rest is printed.
    """
    out, results = ep_run
    layer_passes = PASSES * LAYERS
    slept = results[1]["slept"][mode]
    assert len(slept) == layer_passes and min(slept) > 0.99 * DELAY_S  # sleep() sleeps at least DELAY_S
    reports = {}
    for clock in ("timed", "ticks"):
        with open_trace(out / f"{mode}-{clock}.h5") as trace:
            report = reports[clock] = analyze_timing(trace)
            phase = _grid(trace.timing_rows())
        assert report is not None and report["ranks"] == 2 and report["passes"] == PASSES
        expert = phase[..., EXPERT]  # [N, R, L]
        slowest = expert.sum(axis=2).argmax(axis=1)  # [N]
        np.testing.assert_allclose(report["slowest_rank_share"], np.bincount(slowest, minlength=2) / len(slowest))
        wait = expert.max(axis=1, keepdims=True) - expert  # [N, R, L]
        np.testing.assert_allclose(report["wait_seconds"], wait.mean(axis=1).sum())
        np.testing.assert_allclose(report["expert_wait_seconds_by_rank"], wait.sum(axis=(0, 2)))
        exchange = phase[..., [PHASES.index("dispatch"), PHASES.index("combine")]].sum(axis=(0, 2, 3))  # [R]
        np.testing.assert_allclose(report["exchange_excess_seconds_by_rank"], exchange - exchange.min())
        if clock == "timed":
            assert expert[:, 1].sum() >= sum(slept), "rank 1's expert phase holds every sleep the harness timed"
        else:
            np.testing.assert_allclose(expert[:, 1] - expert[:, 0], DELAY_S, err_msg="rank 1's expert phase: rank 0's plus the delay")
            assert report["slowest_rank_share"] == [0.0, 1.0]
            np.testing.assert_allclose(report["expert_wait_seconds_by_rank"], [layer_passes * DELAY_S, 0.0])
    timed = reports["timed"]
    delay = float(np.mean(slept))
    print(f"{mode}, machine's clock: rank 1 slowest in {timed['slowest_rank_share'][1]:.0%} of passes; rank 0 idle "
          f"{timed['expert_wait_seconds_by_rank'][0] / layer_passes / delay:.2f}x the delay, exchange excess "
          f"{timed['exchange_excess_seconds_by_rank'][0] / layer_passes / delay:.2f}x the delay per layer-pass")


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_phases_sum_to_the_layer_time(ep_run, mode):
    """The phases tile each layer. On the machine's clock their sum never exceeds the layer's time.
    On the counting clock, what a layer holds outside its phases (its own and the phases' readings)
    is the same whole number of ticks in every (pass, layer) of both ranks: the delay rank 1 spends
    in its expert compute is inside a phase (the negative control is test_a_delay_outside_the_phases_fails_the_tiling).

    How much of a layer its phases cover on the machine's clock is the machine's business (the OS
    may deschedule a rank between two phases, the more the busier the machine): printed, not bounded.
    """
    out, _ = ep_run
    with open_trace(out / f"{mode}-timed.h5") as trace:
        rows = trace.timing_rows()
        report = analyze_timing(trace)
    share = np.nan_to_num(rows["phase"]).sum(axis=2) / rows["layer"]  # [N, L]
    assert np.all(share <= 1.0 + 1e-9), "phases never exceed their layer"
    print(f"{mode}: run coverage by rank {np.round(report['phase_coverage_by_rank'], 3).tolist()}; "
          f"{(share >= 0.9).mean():.3f} of (pass, layer) within 10%; worst {share.min():.3f}")
    with open_trace(out / f"{mode}-ticks.h5") as trace:
        outside = _untimed_ticks(trace.timing_rows())
    assert np.unique(outside).size == 1 and outside.flat[0] >= 1, f"ticks outside the phases: {np.unique(outside)}"


def test_a_delay_outside_the_phases_fails_the_tiling(ep_run):
    """Negative control of the tiling check: the counting clock's rows with rank 1's delay taken out of
    its expert phase (as if it slept between phases) leave rank 1's layers more ticks outside their phases."""
    out, _ = ep_run
    with open_trace(out / "exact-ticks.h5") as trace:
        rows = trace.timing_rows()
    moved = rows["phase"].copy()
    moved[rows["rank"] == 1, :, EXPERT] -= DELAY_S
    assert np.unique(_untimed_ticks({**rows, "phase": moved})).size == 2


def _untimed_ticks(rows: dict[str, np.ndarray]) -> np.ndarray:
    """``[N, L]`` whole ticks of each (pass row, layer) outside its phases (rows of the counting clock)."""
    return np.rint((rows["layer"] - np.nan_to_num(rows["phase"]).sum(axis=2)) / TICK_S).astype(np.int64)


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_counts_identical_with_timing_on_and_off(ep_run, mode):
    out, results = ep_run
    for rank_result in results:
        plain = rank_result["counts"][(mode, "plain")]
        for timing in RUNS[1:]:
            for a, b in zip(plain, rank_result["counts"][(mode, timing)], strict=True):
                np.testing.assert_array_equal(a, b)
    with open_trace(out / f"{mode}-plain.h5") as plain, open_trace(out / f"{mode}-timed.h5") as timed:
        np.testing.assert_array_equal(plain.physical_count(per_rank=True), timed.physical_count(per_rank=True))
        np.testing.assert_array_equal(plain.send_count(), timed.send_count())
        assert not plain.has_timing and timed.has_timing
        assert analyze_timing(plain) is None


def test_the_serving_loop_times_every_phase(ep_run):
    """The serving loop (counting clock): every phase in every layer of every pass, and rank 1's expert
    phase holds the delay of every pass, exactly."""
    _, results = ep_run
    for rank, result in enumerate(results):
        timing = result["serving"]
        passes = timing["step_count"]
        assert passes > 0 and (timing["phase_count"] == passes).all(), rank  # every phase, every layer, every pass
    zero, one = (r["serving"] for r in results)
    assert zero["step_count"] == one["step_count"]  # EP ranks step together
    np.testing.assert_allclose(one["phase_seconds_sum"][:, EXPERT] - zero["phase_seconds_sum"][:, EXPERT], DELAY_S * one["step_count"])
