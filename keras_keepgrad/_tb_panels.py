"""TensorBoard pieces of `GradientTensorBoard`: tags, panels, heatmap.

Every tag starts with `gradients/`, so TensorBoard's dashboards show them
in one section; the second component keeps the kinds apart (a layer named
`global_norm` cannot collide with the global norm).
"""

import re

import numpy as np
import tensorflow as tf

LAYER_NORM_PREFIX = "gradients/layer_norm/"
GLOBAL_NORM_TAG = "gradients/global_norm"
NONFINITE_TAG = "gradients/nonfinite"
SKIPPED_STEPS_TAG = "gradients/skipped_steps"
LOSS_SCALE_TAG = "gradients/loss_scale"
HISTOGRAM_PREFIX = "gradients/histogram/"
HEATMAP_TAG = "gradients/heatmap"
LAYOUT_TITLE = "Gradient panels"
DYNAMICS_TITLE = "Training dynamics"

HEATMAP_DESCRIPTION = (
    "log10 of the L2 gradient norm per layer (rows, forward order from the "
    "top) and recorded training step (columns, left to right). Past 1024 "
    "recorded steps a column covers several, all the same number (doubling "
    "as the run grows; the last column may cover fewer), and shows their "
    "geometric mean. Viridis colors from dark purple (smallest "
    "norm in the image) to yellow (largest); black: zero; red: NaN or inf."
)


def layer_norm_tag(layer):
    return LAYER_NORM_PREFIX + layer


def histogram_tag(path):
    return HISTOGRAM_PREFIX + path


def write_layout(loss_scaled, dynamics_charts=()):
    """Writes the custom-scalars layout ("gradient panels") at step 0.

    `dynamics_charts` (`[(title, [tag regex, ...])]`, from
    `_dynamics.tensorboard_charts`) go in a second category, "Training
    dynamics", if any. Must run under a default summary writer. Returns
    False (and writes nothing) if the TensorBoard package is missing.
    """
    try:
        from tensorboard.plugins.custom_scalar import layout_pb2
        from tensorboard.plugins.custom_scalar import metadata
    except ImportError:
        return False

    def chart(title, *patterns):
        return layout_pb2.Chart(
            title=title,
            multiline=layout_pb2.MultilineChartContent(tag=list(patterns)),
        )

    charts = [
        chart("Per-layer gradient norms", "^" + re.escape(LAYER_NORM_PREFIX)),
        chart("Global gradient norm", "^" + re.escape(GLOBAL_NORM_TAG) + "$"),
        chart(
            "Non-finite and skipped steps",
            "^" + re.escape(NONFINITE_TAG) + "$",
            "^" + re.escape(SKIPPED_STEPS_TAG) + "$",
        ),
    ]
    if loss_scaled:
        charts.append(chart("Loss scale", "^" + re.escape(LOSS_SCALE_TAG) + "$"))
    categories = [layout_pb2.Category(title=LAYOUT_TITLE, chart=charts)]
    if dynamics_charts:
        dynamics = [chart(title, *patterns) for title, patterns in dynamics_charts]
        categories.append(layout_pb2.Category(title=DYNAMICS_TITLE, chart=dynamics))
    layout = layout_pb2.Layout(category=categories)
    tf.summary.write(
        tag=metadata.CONFIG_SUMMARY_TAG,
        tensor=tf.constant(layout.SerializeToString()),
        step=0,
        metadata=metadata.create_summary_metadata().SerializeToString(),
    )
    return True


class ScalarWriter:
    """Writes a fixed list of scalar tags, one value each, at a step.

    With `traced=True` one concrete `tf.function` writes them all (traced on
    first use; per step about 6x cheaper than eager `tf.summary.scalar`):
    for frequent writes. The step is a tensor argument, so it is not frozen
    at trace time; `record_if(True)` overrides the condition Keras's
    TensorBoard sets for an integer `update_freq`, which counts executions,
    not batches.

    Args:
        writer: The `tf.summary` writer.
        tags: The tags, in the order `write` receives the values.
        traced: Bool. Write through one `tf.function`.
    """

    def __init__(self, writer, tags, traced):
        self.writer = writer
        self.tags = tuple(tags)
        self.traced = traced
        self._function = None

    def _write_all(self, values, step):
        with self.writer.as_default(step=step), tf.summary.record_if(True):
            for i, tag in enumerate(self.tags):
                tf.summary.scalar(tag, values[i])

    def write(self, step, values):
        values = np.asarray(values, dtype=np.float32)
        if not self.traced:
            self._write_all(values, step)
            return
        if self._function is None:
            self._function = tf.function(self._write_all, autograph=False).get_concrete_function(
                tf.TensorSpec([len(self.tags)], tf.float32),
                tf.TensorSpec([], tf.int64),
            )
        self._function(tf.constant(values), tf.constant(step, dtype=tf.int64))


def finite_values(grad):
    """The finite entries of `grad`, flat (histograms of NaN are all NaN)."""
    values = tf.reshape(grad, [-1])
    finite = tf.math.is_finite(values)
    if bool(tf.reduce_all(finite)):
        return values
    return tf.boolean_mask(values, finite)


# Viridis, sampled at 11 evenly spaced points (matplotlib's `_viridis_data`).
_VIRIDIS = np.array(
    [
        [68, 1, 84],
        [72, 35, 116],
        [64, 67, 135],
        [52, 94, 141],
        [41, 120, 142],
        [32, 144, 140],
        [34, 167, 132],
        [68, 190, 112],
        [121, 209, 81],
        [189, 222, 38],
        [253, 231, 37],
    ],
    dtype=np.float64,
)
_ZERO_COLOR = (0, 0, 0)
_NONFINITE_COLOR = (255, 0, 0)


def colorize(norms):
    """Maps a `[layers, steps]` array of norms to `[layers, steps, 3]` uint8.

    The log10 norms are spread over viridis between their finite minimum
    and maximum; zeros are black and NaN or inf are red.
    """
    norms = np.asarray(norms, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(norms)
    finite = np.isfinite(logs)
    if finite.any():
        low, high = logs[finite].min(), logs[finite].max()
    else:
        low = high = 0.0
    position = np.zeros_like(logs)
    if high > low:
        position[finite] = (logs[finite] - low) / (high - low)
    else:
        position[finite] = 0.5
    scaled = position * (len(_VIRIDIS) - 1)
    below = np.clip(np.floor(scaled).astype(np.int64), 0, len(_VIRIDIS) - 2)
    frac = (scaled - below)[..., None]
    rgb = _VIRIDIS[below] * (1.0 - frac) + _VIRIDIS[below + 1] * frac
    rgb = np.round(rgb).astype(np.uint8)
    rgb[norms == 0] = _ZERO_COLOR
    rgb[~np.isfinite(norms)] = _NONFINITE_COLOR
    return rgb


class Heatmap:
    """The per-layer norms of the recorded steps, as one growing image.

    Every full column covers the same number of recorded steps, its `span`:
    1 at first, doubled whenever the image would grow past `max_columns`
    columns, by merging neighbouring full columns in pairs. Steps recorded
    since the last full column gather in a pending column, shown last (so
    it may cover fewer steps than the others) until it holds `span` steps.
    The time axis is thus uniform and the image always covers the whole
    run in at most `max_columns` columns.

    A column holds the geometric mean of its steps' norms (the mean of
    their logs, every step weighing the same): a column with a non-finite
    norm is non-finite, else one with a zero norm is zero.

    Args:
        max_columns: Int. The most columns in the image. Defaults to `1024`.

    Attributes:
        span: Int. Recorded steps per full column.
        columns: List of `[layers]` float64 arrays: the full columns, then
            the pending one if it holds any step.
        steps: List of ints: the last step of each of `columns`.
    """

    def __init__(self, max_columns=1024):
        self.max_columns = max_columns
        self.span = 1
        self._logs = []  # mean log10 norm of each full column
        self._ends = []
        self._pending_sum = 0.0  # sum of log10 norms of the pending steps
        self._pending_count = 0
        self._pending_end = None

    @staticmethod
    def _log10(norms):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log10(np.asarray(norms, dtype=np.float64))

    def add(self, step, layer_norms):
        """Records one step's per-layer norms."""
        logs = self._log10(layer_norms)
        with np.errstate(invalid="ignore"):  # -inf + inf: NaN, non-finite
            self._pending_sum = self._pending_sum + logs
        self._pending_count += 1
        self._pending_end = step
        if self._pending_count == self.span:
            self._logs.append(self._pending_sum / self.span)
            self._ends.append(step)
            self._pending_sum, self._pending_count, self._pending_end = 0.0, 0, None
        if len(self._logs) + bool(self._pending_count) > self.max_columns:
            self._merge()

    def _merge(self):
        # Pairs of full columns become full columns of twice the span; an
        # odd last one joins the pending steps (fewer than twice the span).
        logs, ends = [], []
        with np.errstate(invalid="ignore"):
            for i in range(0, len(self._logs) - 1, 2):
                logs.append((self._logs[i] + self._logs[i + 1]) / 2.0)
                ends.append(self._ends[i + 1])
            if len(self._logs) % 2:
                self._pending_sum = self._logs[-1] * self.span + self._pending_sum
                if not self._pending_count:
                    self._pending_end = self._ends[-1]
                self._pending_count += self.span
        self._logs, self._ends = logs, ends
        self.span *= 2

    @property
    def columns(self):
        logs = list(self._logs)
        if self._pending_count:
            logs.append(self._pending_sum / self._pending_count)
        with np.errstate(over="ignore"):
            return [np.power(10.0, column) for column in logs]

    @property
    def steps(self):
        return self._ends + ([self._pending_end] if self._pending_count else [])

    def image(self):
        """The heatmap as a `[1, height, width, 3]` uint8 array."""
        rgb = colorize(np.stack(self.columns, axis=1))
        n_layers, n_steps = rgb.shape[:2]
        row = int(np.clip(256 // max(n_layers, 1), 1, 16))
        col = int(np.clip(512 // max(n_steps, 1), 1, 16))
        rgb = np.repeat(np.repeat(rgb, row, axis=0), col, axis=1)
        return rgb[None]
