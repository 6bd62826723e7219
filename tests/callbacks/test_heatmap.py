"""Tests for keras_keepgrad.callbacks.heatmap: columns and colours."""

import numpy as np
import pytest

from keras_keepgrad.callbacks import heatmap as heatmaps


def test_heatmap_color_range_ignores_a_spike():
    # 34 healthy steps near 1e-2 and one spike of 2.9e8 in each of 3
    # layers (1 in 35 cells): the 95th percentile stays below the spike,
    # so the healthy cells keep the color scale.
    logs = np.full((3, 35), -2.0)
    logs[:, :34] += np.linspace(-1.0, 1.0, 34)  # -3 .. -1
    logs[:, 34] = np.log10(2.9e8)
    low, high = heatmaps.color_range(logs)
    finite = np.sort(logs.ravel())
    assert low == pytest.approx(np.percentile(finite, 5))
    assert high == pytest.approx(np.percentile(finite, 95)) and high < -1.0
    # Zeros (-inf) and NaN are left out; nothing finite: a unit range.
    assert heatmaps.color_range([[-np.inf, np.nan, 1.0, 3.0]]) == pytest.approx((1.1, 2.9))
    assert heatmaps.color_range([[np.nan]]) == (-0.5, 0.5)


def test_heatmap_column_edges_and_first_nonfinite():
    # Columns end at steps 4, 8, 10: they cover (0, 4], (4, 8], (8, 10].
    assert heatmaps.column_edges([4, 8, 10]).tolist() == [0.0, 4.0, 8.0, 10.0]
    assert heatmaps.column_edges([7]).tolist() == [6.0, 7.0]
    columns = np.array([[1.0, 1.0], [1.0, 1.0], [np.nan, 1.0], [np.inf, np.nan]])
    assert heatmaps.first_nonfinite(columns, [1, 2, 3, 4]) == (3, 0)
    columns[2, 0] = 1.0
    assert heatmaps.first_nonfinite(columns, [1, 2, 3, 4]) == (4, 0)
    assert heatmaps.first_nonfinite(np.ones((2, 2)), [1, 2]) is None


def test_heatmap_marks_zero_and_nonfinite_and_merges_columns_evenly():
    rgb = heatmaps.colorize(np.array([[1.0, 100.0, 0.0, np.nan, np.inf]]))
    assert rgb[0].tolist() == [
        [68, 1, 84],
        [253, 231, 37],
        [0, 0, 0],
        [255, 0, 0],
        [255, 0, 0],
    ]
    # Two layers, 14 steps, at most 4 columns. Step 5 makes 5 columns: the
    # span doubles to 2 (columns 1-2, 3-4; step 5 pending). Step 9 makes 5
    # again: span 4 (columns 1-4, 5-8; step 9 pending). Steps 9-12 fill a
    # third column and 13-14 are pending, shown last. Each column is the
    # geometric mean of its steps: 10^mean(log10).
    layer_a = [1, 100, 10, 10, 1000, 1000, 1, 100, 10, 10, 10, 10, 10, 1000]
    layer_b = [0, 1, 1, 1, np.nan, 1, 1, 1, 0, np.inf, 1, 1, 1, 1]
    heatmap = heatmaps.Heatmap(max_columns=4)
    for step, norms in enumerate(zip(layer_a, layer_b), start=1):
        heatmap.add(step, norms)
        if step == 5:
            assert heatmap.steps == [2, 4, 5] and heatmap.span == 2
    assert heatmap.steps == [4, 8, 12, 14] and heatmap.span == 4
    columns = np.array(heatmap.columns)
    # Layer a: logs (0+2+1+1)/4 = 1, (3+3+0+2)/4 = 2, 1, pending (1+3)/2 = 2.
    np.testing.assert_array_equal(columns[:, 0], [10.0, 100.0, 10.0, 100.0])
    # Layer b: a zero makes 0; a NaN, or an inf beside a zero, non-finite.
    assert columns[0, 1] == 0.0 and columns[3, 1] == 1.0
    assert np.isnan(columns[1, 1]) and np.isnan(columns[2, 1])
    # 2 layers x 4 columns of 16 x 16 pixels; finite log10 norms from 0
    # (bottom of viridis) to 2 (top): 1 is its middle.
    image = heatmap.image()[0]
    assert image.shape == (32, 64, 3)
    assert image[8, ::16].tolist() == [[32, 144, 140], [253, 231, 37]] * 2
    assert image[24, ::16].tolist() == [[0, 0, 0], [255, 0, 0], [255, 0, 0], [68, 1, 84]]


def test_heatmap_columns_of_a_long_run_cover_equal_spans():
    # 3000 steps over at most 1024 columns: 1024 < 3000 <= 4096, so the span
    # is 4: 750 full columns of 4 steps each, no pending one. The geometric
    # mean of steps 4k-3 .. 4k with norm 10^step is 10^(4k - 1.5).
    heatmap = heatmaps.Heatmap(max_columns=1024)
    for step in range(1, 3001):
        heatmap.add(step, [10.0 ** (step / 1000.0)])
    assert heatmap.steps == list(range(4, 3001, 4))
    assert len(heatmap.columns) == 750 and heatmap.span == 4
    np.testing.assert_allclose(
        np.array(heatmap.columns)[:, 0],
        10.0 ** ((np.arange(4, 3001, 4) - 1.5) / 1000.0),
        rtol=1e-12,
    )
    heatmap.add(3001, [1.0])  # a partial column of 1 step, shown last
    assert heatmap.steps[-2:] == [3000, 3001] and len(heatmap.columns) == 751
