"""Tests for keras_keepgrad.callbacks.heatmap: columns and colours."""

import numpy as np

from keras_keepgrad.callbacks import heatmap as heatmaps


def test_heatmap_color_range_is_fixed_and_names_are_elided():
    # One scale for every run: 1e-8 to 1e4, whatever the norms.
    assert heatmaps.color_range() == (-8.0, 4.0)
    assert heatmaps.color_range(np.full((3, 35), -2.0)) == (-8.0, 4.0)
    # Names of up to 32 characters whole; longer: 16 + "…" + 15.
    assert heatmaps.elide("expanded_conv_depthwise_BN") == "expanded_conv_depthwise_BN"
    long = "a_very_long_layer_name_of_forty_chars_xy"
    assert heatmaps.elide(long) == "a_very_long_laye\u2026_forty_chars_xy"
    # 270 plot pixels hold 270 // (1.3 * 15 pt * 100 / 72) = 9 names: 9
    # layers are all named, 105 every 12th (ceil(105 / 9)).
    assert heatmaps.labelled_rows(9) == list(range(9))
    assert heatmaps.labelled_rows(105) == list(range(0, 105, 12))


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
    # On the fixed scale 1e-8 .. 1e4 over 11 viridis samples (10 intervals):
    # 1 is at 8/12 (sample 6.67: 1/3 of [34, 167, 132] + 2/3 of
    # [68, 190, 112]), 100 at 10/12 (sample 8.33: 2/3 of [121, 209, 81] +
    # 1/3 of [189, 222, 38]); beyond the scale, the end colors.
    rgb = heatmaps.colorize(np.array([[1.0, 100.0, 0.0, np.nan, np.inf, 1e-9, 1e5]]))
    assert rgb[0].tolist() == [
        [57, 182, 119],
        [144, 213, 67],
        [0, 0, 0],
        [255, 0, 0],
        [255, 0, 0],
        [68, 1, 84],
        [253, 231, 37],
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
    # 2 layers x 4 columns of 16 x 16 pixels. 10 is at 9/12 of the scale
    # (sample 7.5: the mean of [68, 190, 112] and [121, 209, 81], rounded
    # half to even), 100 at 10/12 and 1 at 8/12, as above.
    image = heatmap.image()[0]
    assert image.shape == (32, 64, 3)
    assert image[8, ::16].tolist() == [[94, 200, 96], [144, 213, 67]] * 2
    assert image[24, ::16].tolist() == [[0, 0, 0], [255, 0, 0], [255, 0, 0], [57, 182, 119]]


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
