"""`GradientReport` and `GradientMonitor` states on the one-weight model.

Run by `tests/callbacks/test_report.py` on every backend. The one-weight
model of `conftest.py`: w = 3, mse, a batch c * [[1], [2]] with y = 0 has
the gradient 2 w c^2 (1 + 4) / 2 = 15 c^2, so c = 1 gives 15, c = 1e-4
gives 1.5e-7 (below VANISHING_THRESHOLD, 1e-5) and c = 100 gives 1.5e5
(above EXPLODING_THRESHOLD, 1e3). With SGD(0.1) and c = 1 the gradients of
three steps are 15, 7.5 and 3.75 (w = 3, 1.5, 0.75).
"""

import warnings

import keras
import numpy as np
import pytest
from conftest import X
from conftest import one_weight

import keras_keepgrad as kg


def batches(scales):
    """One batch c * X per scale c, in order, and zero targets."""
    x = np.concatenate([c * X for c in scales]).astype("float32")
    return x, np.zeros_like(x)


def fit(model, scales, callbacks):
    x, y = batches(scales)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=callbacks)


def monitor_messages(caught):
    # Backends warn of their own things too (PyTorch of NumPy's `copy`).
    return [str(w.message) for w in caught if str(w.message).startswith("GradientMonitor")]


def report_values_by_hand(tmp_path, capsys):
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    report = kg.callbacks.GradientReport(
        png=str(tmp_path / "report.png"), html=str(tmp_path / "out" / "report.html")
    )
    fit(model, [1, 1, 1], [report])
    (row,) = report.rows
    # Norms 15, 7.5, 3.75: mean 26.25 / 3 = 8.75.
    assert row == {
        "layer": "dense_0",
        "steps": 3,
        "mean": 8.75,
        "min": 3.75,
        "max": 15.0,
        "last": 3.75,
        "nonfinite": 0,
        "vanishing_steps": 0,
        "verdict": "ok",
    }
    assert report.backend == keras.backend.backend()
    printed = capsys.readouterr().out
    assert "8.750e+00" in printed and "1.500e+01" in printed and "3.750e+00" in printed
    assert f"backend {keras.backend.backend()}" in printed
    assert report.table().splitlines()[2].split() == [
        "dense_0", "8.750e+00", "3.750e+00", "1.500e+01", "3.750e+00", "0", "0/3", "ok",
    ]  # fmt: skip
    # The PNG: 11 x (1.4 + 0.3 * 1 layer) inches at 100 dpi.
    with open(tmp_path / "report.png", "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1100, 170)
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page
    assert '<td class="layer">dense_0</td><td class="verdict" style="color:#1a7f37">ok</td>' in page
    numbers = ["8.750e+00", "3.750e+00", "1.500e+01", "3.750e+00", "0", "0/3"]
    assert "</svg></td>" + "".join(f"<td>{n}</td>" for n in numbers) + "</tr>" in page
    # The mean's dot on the 200-pixel scale 1e-8 .. 1e4: (log10(8.75) + 8) / 12
    # * 200 = 149.03.
    assert '<circle cx="149.0" cy="8.0"' in page
    assert '<span style="background:#1a7f37">1 ok</span>' in page


def report_verdicts():
    # lr 0 keeps w = 3: every step's norm is 15 c^2.
    vanishing, exploding = one_weight(), one_weight()
    reports = []
    for model, scale in ((vanishing, 1e-4), (exploding, 100.0)):
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        reports.append(kg.callbacks.GradientReport(print_table=False))
        fit(model, [scale, scale], [reports[-1]])
    (low,), (high,) = (r.rows for r in reports)
    assert low["verdict"] == "vanishing" and low["vanishing_steps"] == 2
    assert low["mean"] == pytest.approx(1.5e-7, rel=1e-6)
    assert high["verdict"] == "exploding" and high["vanishing_steps"] == 0
    assert high["mean"] == pytest.approx(1.5e5, rel=1e-6)


def monitor_defaults_catch_vanishing_and_exploding():
    # GradientMonitor() with no argument: 10 checks below 1e-5 in a row make
    # a vanishing layer; a global norm above 1e3 explodes at once.
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    monitor = kg.callbacks.GradientMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, [1e-4] * 10 + [100.0], [monitor])
    assert [(e["kind"], e["step"], e["since"]) for e in monitor.events] == [
        ("vanishing", 10, 1),
        ("exploding", 11, 11),
    ]
    assert "summary of steps 1-11" in monitor_messages(caught)[-1]


def monitor_reports_a_state_once_with_its_end():
    # Scales: tiny at steps 1-4, 6-7 (norm 1.5e-7), else 1 (norm 15). With
    # vanishing_steps=3 the state begins at step 3 (since step 1); step 5
    # alone does not end it (recovery_steps=3); steps 8, 9, 10 do, at 10:
    # the state covered steps 1-7, 6 checks below.
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    monitor = kg.callbacks.GradientMonitor(vanishing_steps=3, recovery_steps=3)
    tiny = 1e-4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, [tiny] * 4 + [1] + [tiny] * 2 + [1] * 5, [monitor])
    events = [(e["kind"], e["step"], e["since"], e.get("until")) for e in monitor.events]
    assert events == [("vanishing", 3, 1, None), ("vanishing_ended", 10, 1, 7)]
    assert monitor.events[1]["checks"] == 6
    assert "lasted steps 1-7 (6 checks)" in monitor.events[1]["message"]
    assert monitor.states == [
        {
            "kind": "vanishing",
            "layers": ["dense_0"],
            "since": 1,
            "until": 7,
            "checks": 6,
            "ongoing": False,
        }
    ]
    assert monitor.summary() == "'dense_0' vanishing: steps 1-7 (6 checks)"
    messages = monitor_messages(caught)
    assert len(messages) == 3 and messages[2].endswith("steps 1-7 (6 checks)")


def monitor_summary_of_a_state_that_lasts_the_whole_run():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    monitor = kg.callbacks.GradientMonitor(vanishing_steps=2)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        fit(model, [1e-4] * 4, [monitor])
    assert [e["kind"] for e in monitor.events] == ["vanishing"]
    assert monitor.summary() == (
        "'dense_0' vanishing: steps 1-4 (4 checks), until the end, the whole run"
    )
