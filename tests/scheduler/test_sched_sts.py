"""STS calibration: recovery of known temperatures, censoring, persistence, report, diagram, online."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from scheduler.sts import (
    CalibrationTraces,
    OnlineSTS,
    STSCalibration,
    calibration_report,
    expected_calibration_error,
    fit_sts,
    prefix_ece,
    reliability_diagram,
)
from scheduler.sts import main as sts_main

GAMMA = 6
TRUE_TEMPERATURES = np.array([0.5, 0.7, 1.0, 1.4, 2.0, 2.5])


def synthetic_traces(
    n: int, seed: int, temperatures: np.ndarray = TRUE_TEMPERATURES
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits, accepted, p): position k is accepted with probability p[:, k] given 1..k-1 were.

    The head's logits are logit(p) * T_k, so sigmoid(logit / T_k) is exactly calibrated.
    """
    rng = np.random.default_rng(seed)
    p = rng.beta(4.0, 1.5, size=(n, GAMMA))
    logits = np.log(p / (1 - p)) * temperatures
    accepted_each = rng.random((n, GAMMA)) < p
    accepted = np.argmin(np.concatenate([accepted_each, np.zeros((n, 1), bool)], axis=1), axis=1)
    return logits, accepted, p


def test_fit_recovers_known_temperatures_and_removes_miscalibration() -> None:
    logits, accepted, _ = synthetic_traces(8000, seed=0)
    traces = CalibrationTraces.from_arrays(logits, accepted)
    calibration = fit_sts(traces)
    # Early positions see every trace; later ones only the survivors, so they get a looser tolerance.
    np.testing.assert_allclose(np.log(calibration.temperatures[:3]), np.log(TRUE_TEMPERATURES[:3]), atol=0.12)
    np.testing.assert_allclose(np.log(calibration.temperatures), np.log(TRUE_TEMPERATURES), atol=0.5)
    report = calibration_report(traces, calibration)
    assert report.pooled_before > 0.03
    assert report.pooled_after < 0.015 and report.pooled_after < report.pooled_before / 3
    assert np.all(report.ece_after <= report.ece_before + 0.01)
    assert report.observed.tolist() == [8000] * GAMMA
    assert "all" in report.format() and len(report.format().splitlines()) == GAMMA + 2
    # Held-out traces from the same source stay calibrated.
    held_logits, held_accepted, _ = synthetic_traces(8000, seed=1)
    _, held_pooled = prefix_ece(CalibrationTraces.from_arrays(held_logits, held_accepted), calibration)
    assert held_pooled < 0.02


def test_calibration_preserves_order_within_each_position() -> None:
    logits, _, _ = synthetic_traces(500, seed=2)
    calibrated = STSCalibration(np.array([0.3, 0.5, 1.0, 2.0, 3.0, 7.0])).calibrate(logits)
    for k in range(GAMMA):
        np.testing.assert_array_equal(
            np.argsort(calibrated[:, k], kind="stable"), np.argsort(logits[:, k], kind="stable")
        )
    assert np.all((calibrated >= 0) & (calibrated <= 1))


def test_censoring_labels() -> None:
    traces = CalibrationTraces.from_arrays(np.zeros((4, 3)), accepted=[0, 2, 2, 0], verified=[3, 2, 3, 0])
    survived, observed = traces.labels()
    # Trace 0 rejected x1; trace 1 accepted both verified tokens (position 3 unknown); trace 2 rejected x3;
    # trace 3 verified nothing (every position unknown).
    np.testing.assert_array_equal(survived, [[0, 0, 0], [1, 1, 0], [1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(observed, [[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]])


def test_fit_under_causal_censoring_matches_the_uncensored_fit() -> None:
    """Verification lengths chosen from the (raw) confidences only, as the scheduler does, leave the fit
    unbiased.
    """
    logits, accepted, _ = synthetic_traces(12000, seed=3)
    full = fit_sts(CalibrationTraces.from_arrays(logits, accepted))
    raw_prefix = np.cumprod(1 / (1 + np.exp(-logits)), axis=1)
    verified = np.maximum(1, (raw_prefix >= 0.35).sum(axis=1))  # a causal threshold rule
    assert verified.min() < GAMMA  # censoring really happens
    censored_traces = CalibrationTraces.from_arrays(logits, np.minimum(accepted, verified), verified)
    censored = fit_sts(censored_traces)
    np.testing.assert_allclose(np.log(censored.temperatures[:3]), np.log(full.temperatures[:3]), atol=0.15)
    # Judged on the complete (uncensored) labels, the censored fit is as good as the full one.
    _, full_ece = prefix_ece(CalibrationTraces.from_arrays(logits, accepted), full)
    _, censored_ece = prefix_ece(CalibrationTraces.from_arrays(logits, accepted), censored)
    assert censored_ece < full_ece + 0.01


def test_unobserved_position_keeps_temperature_one() -> None:
    logits, accepted, _ = synthetic_traces(2000, seed=4)
    verified = np.full(2000, 2)
    calibration = fit_sts(CalibrationTraces.from_arrays(logits, np.minimum(accepted, 2), verified))
    np.testing.assert_array_equal(calibration.temperatures[2:], 1.0)
    assert calibration.temperatures[0] != 1.0


def test_expected_calibration_error_by_hand() -> None:
    ece = expected_calibration_error(
        np.array([0.1, 0.1, 0.9, 0.9, 1.0]), np.array([0, 1, 1, 1, 1]), num_bins=10
    )
    # bin 1: |0.1 - 0.5| * 2/5; bin 9 (1.0 lands in the last bin): |0.9333 - 1| * 3/5
    assert ece == pytest.approx(0.4 * 2 / 5 + (1 - (0.9 + 0.9 + 1.0) / 3) * 3 / 5)
    assert np.isnan(expected_calibration_error(np.zeros(0), np.zeros(0)))
    with pytest.raises(ValueError):
        expected_calibration_error(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError):
        expected_calibration_error(np.zeros(3), np.zeros(3), num_bins=0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        expected_calibration_error(np.array([0.5, 1.5]), np.zeros(2))


def test_save_load_and_bad_files(tmp_path: Path) -> None:
    calibration = STSCalibration(np.array([0.5, 1.25, 3.0]))
    path = calibration.save(tmp_path / "cal" / "sts.json")
    loaded = STSCalibration.load(path)
    np.testing.assert_array_equal(loaded.temperatures, calibration.temperatures)
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="JSON"):
        STSCalibration.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"format": "dspark-sps/1"}')
    with pytest.raises(ValueError, match="not an STS calibration"):
        STSCalibration.load(tmp_path / "other.json")
    for temperatures in ([], [1.0, 0.0], [1.0, np.nan], [[1.0]]):
        with pytest.raises(ValueError, match="temperatures"):
            STSCalibration(np.array(temperatures))


def test_bad_traces_and_logits_raise() -> None:
    with pytest.raises(ValueError, match="shape"):
        CalibrationTraces.from_arrays(np.zeros(3), [0, 0, 0])
    with pytest.raises(ValueError, match="finite"):
        CalibrationTraces.from_arrays(np.full((1, 2), np.nan), [0])
    with pytest.raises(ValueError, match="accepted must be <= verified"):
        CalibrationTraces.from_arrays(np.zeros((1, 3)), [2], [1])
    with pytest.raises(ValueError, match="verified must be <= gamma"):
        CalibrationTraces.from_arrays(np.zeros((1, 3)), [0], [4])
    with pytest.raises(ValueError, match=">= 0"):
        CalibrationTraces.from_arrays(np.zeros((1, 3)), [-1])
    for bad in ([0.5], [np.nan], ["x"]):
        with pytest.raises(ValueError, match="integers"):
            CalibrationTraces.from_arrays(np.zeros((1, 3)), bad)
    with pytest.raises(ValueError, match="shape"):
        CalibrationTraces.from_arrays(np.zeros((2, 3)), [0])
    with pytest.raises(ValueError, match="gamma"):
        STSCalibration.identity(3).calibrate(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="finite"):
        STSCalibration.identity(2).calibrate(np.array([[0.0, np.inf]]))
    with pytest.raises(ValueError, match="temperature_grid"):
        fit_sts(CalibrationTraces.from_arrays(np.zeros((1, 2)), [0]), temperature_grid=np.array([0.0, 1.0]))


def test_reliability_diagram_is_a_png(tmp_path: Path) -> None:
    logits, accepted, _ = synthetic_traces(3000, seed=5)
    traces = CalibrationTraces.from_arrays(logits, accepted)
    path = reliability_diagram(traces, fit_sts(traces), tmp_path / "plots" / "reliability.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_online_refits_when_calibration_drifts() -> None:
    online = OnlineSTS(GAMMA, window=3000, ece_bound=0.03, min_records=1000, check_every=500)
    logits, accepted, _ = synthetic_traces(3000, seed=6)  # the head is miscalibrated; online starts at T = 1
    refits = [
        online.record(logits[i : i + 100], accepted[i : i + 100], np.full(100, GAMMA))
        for i in range(0, 3000, 100)
    ]
    assert any(refits) and online.refits >= 1
    assert online.window_ece() < 0.03
    np.testing.assert_allclose(
        np.log(online.calibration.temperatures[:2]), np.log(TRUE_TEMPERATURES[:2]), atol=0.2
    )
    np.testing.assert_allclose(online.calibrate(logits[:3]), online.calibration.calibrate(logits[:3]))


def test_online_keeps_a_calibrated_head() -> None:
    online = OnlineSTS(GAMMA, window=4000, ece_bound=0.03, min_records=1000, check_every=1000)
    logits, accepted, _ = synthetic_traces(4000, seed=7, temperatures=np.ones(GAMMA))
    for i in range(0, 4000, 250):
        assert not online.record(logits[i : i + 250], accepted[i : i + 250], np.full(250, GAMMA))
    assert online.refits == 0 and online.window_ece() < 0.03


def test_online_window_keeps_the_latest_records() -> None:
    online = OnlineSTS(2, window=5, min_records=1, check_every=10**6)
    logits = np.arange(16, dtype=np.float64).reshape(8, 2)
    online.record(logits[:3], [0, 1, 2], [2, 2, 2])
    online.record(logits[3:], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1])
    window = online.window_traces()
    assert sorted(window.logits[:, 0].tolist()) == logits[3:, 0].tolist()
    online.record(np.zeros((12, 2)), np.zeros(12, dtype=int), np.zeros(12, dtype=int))  # more than the window
    assert np.all(online.window_traces().logits == 0)


def test_online_record_and_threaded_refit_share_one_event_loop() -> None:
    logits, accepted, _ = synthetic_traces(2000, seed=8)
    online = OnlineSTS(GAMMA, window=2000, ece_bound=0.01, min_records=500, check_every=10**9)

    async def main() -> bool:
        for i in range(0, 1000, 100):
            online.record(logits[i : i + 100], accepted[i : i + 100], np.full(100, GAMMA))
        refit = asyncio.create_task(asyncio.to_thread(online.check))
        for i in range(1000, 2000, 100):  # live records keep arriving while the refit runs in a thread
            online.record(logits[i : i + 100], accepted[i : i + 100], np.full(100, GAMMA))
            await asyncio.sleep(0)
        return await refit

    assert asyncio.run(main()) is True
    assert online.refits == 1 and online.window_traces().logits.shape == (2000, GAMMA)


def test_online_bad_arguments() -> None:
    with pytest.raises(ValueError):
        OnlineSTS(0)
    with pytest.raises(ValueError, match="min_records"):
        OnlineSTS(3, window=10, min_records=20)
    with pytest.raises(ValueError, match="ece_bound"):
        OnlineSTS(3, ece_bound=0.0)
    with pytest.raises(ValueError, match="initial"):
        OnlineSTS(3, initial=STSCalibration.identity(4))
    with pytest.raises(ValueError, match="gamma"):
        OnlineSTS(3).record(np.zeros((1, 4)), [0], [0])


def test_command_line_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logits, accepted, _ = synthetic_traces(2000, seed=9)
    np.savez(tmp_path / "traces.npz", logits=logits, accepted=accepted)
    sts_main(
        [str(tmp_path / "traces.npz"), "--out", str(tmp_path / "sts.json"), "--plot", str(tmp_path / "r.png")]
    )
    assert STSCalibration.load(tmp_path / "sts.json").gamma == GAMMA
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert "ECE STS" in capsys.readouterr().out
    np.savez(tmp_path / "bad.npz", logits=logits)
    with pytest.raises(SystemExit):
        sts_main([str(tmp_path / "bad.npz"), "--out", str(tmp_path / "x.json")])
