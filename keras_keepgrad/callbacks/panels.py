"""TensorBoard pieces of `GradientTensorBoard`: tags, panels, heatmap.

Every tag starts with `gradients/`, so TensorBoard's dashboards show them
in one section; the second component keeps the kinds apart (a layer named
`global_norm` cannot collide with the global norm).
"""

import re
import time
import weakref

import numpy as np
import tensorflow as tf

LAYER_NORM_PREFIX = "gradients/layer_norm/"
GLOBAL_NORM_TAG = "gradients/global_norm"
NONFINITE_TAG = "gradients/nonfinite"
SKIPPED_STEPS_TAG = "gradients/skipped_steps"
LOSS_SCALE_TAG = "gradients/loss_scale"
HEATMAP_TAG = "gradients/heatmap"
LAYOUT_TITLE = "Gradient panels"
DYNAMICS_TITLE = "Training dynamics"

LOG10_NORM_PREFIX = "log10_grad_norm/"
LOG10_GLOBAL_TAG = LOG10_NORM_PREFIX + "global"

HEATMAP_DESCRIPTION = (
    "log10 of the L2 gradient norm per layer (rows, forward order from the "
    "top, numbered as in the log10_grad_norm tags) and training step "
    "(x axis). Past 1024 recorded steps a column covers several, all the "
    "same number (doubling as the run grows; the last column may cover "
    "fewer), and shows their geometric mean. Colors: viridis from the 5th "
    "to the 95th percentile of the finite log10 norms in the figure (at "
    "least one decade wide), so that a short spike cannot wash out the rest; "
    "values beyond are drawn in the end colors (the color bar's triangles). "
    "Black: a zero norm; red: NaN or inf, and a red dashed line with its "
    "step marks the first non-finite step. The right-hand labels give each "
    "layer's norm in the last column."
)

HISTOGRAM_SUFFIX = "/gradient"
NONFINITE_HISTOGRAM_SUFFIX = "/gradient_nonfinite"

HISTOGRAM_DESCRIPTION = (
    "The finite entries of this variable's kept gradient, beside the "
    "variable's weights (`.../histogram`). A step whose entries were all "
    "NaN or inf has no values here: see `.../gradient_nonfinite`."
)
NONFINITE_HISTOGRAM_DESCRIPTION = (
    "Written only at the steps where this variable's gradient held NaN or "
    "inf: one value per such entry, -1 for -inf, 0 for NaN, +1 for +inf "
    "(the count at 0 is the number of NaN entries). When it covers all "
    "entries, the step's `.../gradient` slice is empty."
)

LOG10_DESCRIPTION = (
    "log10 of the L2 norm of this layer's gradients (all its trainable "
    "variables): -6 is 1e-6. The number before the layer name is its "
    "position in forward order. NaN where the gradients held NaN or inf "
    "(see gradients/nonfinite); -inf for an all-zero gradient."
)


def layer_norm_tag(layer):
    return LAYER_NORM_PREFIX + layer


def histogram_tag(path):
    """Beside Keras's `<path>/histogram` of the weights: same category."""
    return path + HISTOGRAM_SUFFIX


def nonfinite_histogram_tag(path):
    return path + NONFINITE_HISTOGRAM_SUFFIX


def log10_norm_tags(layers):
    """`log10_grad_norm/<position>_<layer>`: forward order sorts as text."""
    width = max(2, len(str(len(layers) - 1)))
    return [f"{LOG10_NORM_PREFIX}{i:0{width}d}_{layer}" for i, layer in enumerate(layers)]


def write_layout(layers, loss_scaled, count_skipped, dynamics_charts=()):
    """Writes the custom-scalars layout ("gradient panels") at step 0.

    One chart per layer (its log10 norm, titled with its position and
    name: TensorBoard colors lines by run, so a chart of many layers could
    only name them on hover), the global norm, the non-finite (and skipped)
    steps. The loss scale has a category of its own, written only under a
    `LossScaleOptimizer`: TensorBoard merges the layouts of all runs by
    category title, and a run without the optimizer has nothing to show.
    `dynamics_charts` (`[(title, [tag regex, ...])]`, from
    `_dynamics.tensorboard_charts`) go in a category of their own,
    "Training dynamics", if any. Must run under a default summary writer. Returns False (and writes
    nothing) if the TensorBoard package is missing.
    """
    try:
        from tensorboard.plugins.custom_scalar import layout_pb2
        from tensorboard.plugins.custom_scalar import metadata
    except ImportError:
        return False

    def chart(title, *tags):
        return layout_pb2.Chart(
            title=title,
            multiline=layout_pb2.MultilineChartContent(
                tag=["^" + re.escape(tag) + "$" for tag in tags]
            ),
        )

    nonfinite = [NONFINITE_TAG] + ([SKIPPED_STEPS_TAG] if count_skipped else [])
    charts = [
        chart("Global gradient norm, log10", LOG10_GLOBAL_TAG),
        chart(
            "Non-finite steps (1: NaN or inf)"
            + (" and steps skipped by the loss scale" if count_skipped else ""),
            *nonfinite,
        ),
    ]
    for tag, layer in zip(log10_norm_tags(layers), layers):
        position = tag[len(LOG10_NORM_PREFIX) :].split("_", 1)[0]
        charts.append(chart(f"{position} {layer}: gradient norm, log10", tag))
    categories = [layout_pb2.Category(title=LAYOUT_TITLE, chart=charts)]
    if loss_scaled:
        categories.append(
            layout_pb2.Category(
                title=LAYOUT_TITLE + ": loss scale",
                chart=[chart("Loss scale (LossScaleOptimizer)", LOSS_SCALE_TAG)],
            )
        )
    if dynamics_charts:
        dynamics = [
            layout_pb2.Chart(
                title=title, multiline=layout_pb2.MultilineChartContent(tag=list(patterns))
            )
            for title, patterns in dynamics_charts
        ]
        categories.append(layout_pb2.Category(title=DYNAMICS_TITLE, chart=dynamics))
    layout = layout_pb2.Layout(category=categories)
    tf.summary.write(
        tag=metadata.CONFIG_SUMMARY_TAG,
        tensor=tf.constant(layout.SerializeToString()),
        step=0,
        metadata=metadata.create_summary_metadata().SerializeToString(),
    )
    return True


_WRITERS = weakref.WeakSet()
_ROW_FUNCTIONS = {}  # number of tags -> concrete function, for every writer


def _writer_resource(writer):
    # TensorFlow 2.21's `tf.summary.create_file_writer` returns a
    # `_ResourceSummaryWriter` whose `_resource` is its handle: passed as
    # an argument, one traced function serves every writer (a `fit` makes
    # new ones), where capturing the writer would trace again per `fit`.
    return writer._resource


def _scalar_metadata():
    from tensorboard.plugins.scalar import metadata

    return metadata.create_summary_metadata(display_name=None, description=None).SerializeToString()


def _rows_function(n_tags):
    """A concrete function writing `[rows, n_tags]` scalars at `[rows]` steps.

    Its arguments: the writer's resource handle, the values, the steps, the
    `[n_tags]` tags and the serialized scalar metadata. It writes each
    value with `WriteSummary`, as `tf.summary.write` does but with the tag
    as given (`tf.summary.scalar` would prefix the loop's name scope) and
    without `record_if` (Keras sets one that counts executions).
    """
    function = _ROW_FUNCTIONS.get(n_tags)
    if function is not None:
        return function
    from tensorflow.python.ops import gen_summary_ops  # no public op taking a handle

    def write_rows(resource, values, steps, tags, metadata):
        def body(j):
            # One slice and one unstack per row, not one slice per value.
            row = tf.unstack(values[j], num=n_tags)
            step = steps[j]
            for i in range(n_tags):
                gen_summary_ops.write_summary(resource, step, row[i], tags[i], metadata)
            return (j + 1,)

        return tf.while_loop(lambda j: j < tf.shape(steps)[0], body, (tf.constant(0),))

    function = tf.function(write_rows, autograph=False).get_concrete_function(
        tf.TensorSpec([], tf.resource),
        tf.TensorSpec([None, n_tags], tf.float32),
        tf.TensorSpec([None], tf.int64),
        tf.TensorSpec([n_tags], tf.string),
        tf.TensorSpec([], tf.string),
    )
    _ROW_FUNCTIONS[n_tags] = function
    return function


def flush_all():
    """Writes every buffered row, e.g. before an error ends `fit` (which
    then calls no `on_train_end`). A writer that fails is skipped."""
    for writer in list(_WRITERS):
        try:
            writer.flush()
        except (tf.errors.OpError, OSError):
            pass


class ScalarWriter:
    """Writes a fixed list of scalar tags, one value each per step.

    With `traced=True` the rows are buffered and written in bulk by one
    concrete `tf.function` (traced once per process and number of tags, for
    every writer), a row costing about a tenth of one eager
    `tf.summary.scalar` per tag: for frequent writes.
    The buffer is written once it holds `max_rows` rows or its first row is
    `max_seconds` old, and on `flush()` (at each epoch end and before the
    writer closes), so TensorBoard, which reloads every few seconds,
    shows the steps about as soon as without buffering. The steps are
    tensors, so they are not frozen at trace time, and the writes ignore
    the `record_if` condition Keras's TensorBoard sets for an integer
    `update_freq` (it counts executions, not batches); eager writes
    (`traced=False`) override it with `record_if(True)`. Values are written
    as float32, as `tf.summary.scalar` writes them.

    Args:
        writer: The `tf.summary` writer.
        tags: The tags, in the order `write` receives the values.
        traced: Bool. Buffer and write through one `tf.function`.
        max_rows: Int. Write the buffer once it holds this many rows.
        max_seconds: Float. Write it once its first row is this old.
    """

    def __init__(self, writer, tags, traced, max_rows=256, max_seconds=1.0):
        _WRITERS.add(self)
        self.writer = writer
        self.tags = tuple(tags)
        self.traced = traced
        self.max_rows = max_rows
        self.max_seconds = max_seconds
        self._function = None
        self._rows = []
        self._steps = []
        self._since = None

    def write(self, step, values, now=False):
        """Adds one step's values; `now=True` writes the buffer at once."""
        values = np.asarray(values, dtype=np.float32)
        if not self.traced:
            self._write_eager(values, step)
            return
        if self._since is None:
            self._since = time.monotonic()
        self._rows.append(values)
        self._steps.append(step)
        if (
            now
            or len(self._rows) >= self.max_rows
            or time.monotonic() - self._since >= self.max_seconds
        ):
            self.flush()

    def _write_eager(self, values, step):
        with self.writer.as_default(step=step), tf.summary.record_if(True):
            for i, tag in enumerate(self.tags):
                tf.summary.scalar(tag, values[i])

    def flush(self):
        """Writes the buffered rows (to the writer, not yet to the file)."""
        if not self._rows:
            return
        rows, steps = np.stack(self._rows), np.asarray(self._steps, np.int64)
        self._rows, self._steps, self._since = [], [], None
        if self._function is None:
            self._function = _rows_function(len(self.tags))
            self._tag_tensor = tf.constant(self.tags)
        self._function(
            _writer_resource(self.writer),
            tf.constant(rows),
            tf.constant(steps),
            self._tag_tensor,
            tf.constant(_scalar_metadata()),
        )


def nonfinite_kinds(values):
    """float32: -1 for each -inf entry, 0 for each NaN, +1 for each +inf."""
    values = tf.reshape(values, [-1])
    bad = tf.boolean_mask(values, ~tf.math.is_finite(values))
    return tf.where(tf.math.is_nan(bad), 0.0, tf.sign(tf.cast(bad, tf.float32)))


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


def color_range(logs, low_percentile=5.0, high_percentile=95.0, min_width=1.0):
    """The log10 range the heatmap's colors span.

    From the `low_percentile`-th to the `high_percentile`-th percentile of
    the finite values, widened about its middle to at least `min_width`
    decades: a spike in a few cells (one step of 20 or more, in every
    layer) falls beyond it (drawn in the end color) instead of squeezing
    every other cell into one color.

    Returns:
        `(low, high)` floats; `(-0.5, 0.5)` when nothing is finite.
    """
    logs = np.asarray(logs, np.float64)
    finite = logs[np.isfinite(logs)]
    if not finite.size:
        return -0.5, 0.5
    low, high = np.percentile(finite, [low_percentile, high_percentile])
    if high - low < min_width:
        middle = (low + high) / 2.0
        low, high = middle - min_width / 2.0, middle + min_width / 2.0
    return float(low), float(high)


def column_edges(steps):
    """x edges of the heatmap's columns: column i covers steps (e_i, e_i+1].

    Each column ends at its last step; the first starts one column width
    (its neighbour's, or 1 step) before its end.
    """
    steps = np.asarray(steps, np.float64)
    first = steps[1] - steps[0] if len(steps) > 1 else 1.0
    return np.concatenate([[steps[0] - first], steps])


def first_nonfinite(columns, steps):
    """`(step, layer index)` of the first non-finite cell, or None."""
    bad = ~np.isfinite(np.asarray(columns, np.float64))  # [steps, layers]
    if not bad.any():
        return None
    column = int(np.flatnonzero(bad.any(axis=1))[0])
    return int(steps[column]), int(np.flatnonzero(bad[column])[0])


def render_heatmap(heatmap, layers, title="Gradient L2 norm per layer, log10"):
    """The heatmap as a labelled figure: `[1, height, width, 3]` uint8.

    Layers on the rows (forward order, numbered), training steps on the x
    axis, a color bar in log10 units over `color_range`, zero norms black
    and NaN or inf red (both named in a legend), a dashed line at the first
    non-finite step, and each layer's last value on the right. Drawn with
    matplotlib's Agg canvas, without `pyplot` (no global state).
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    columns = np.stack(heatmap.columns)  # [steps, layers]
    steps = heatmap.steps
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(columns).T  # [layers, steps]
    low, high = color_range(logs)
    n_layers = len(layers)
    width = 10.0
    height = min(2.0 + 0.32 * n_layers, 24.0)
    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_axes([0.2, 1.0 / height, 0.58, 1.0 - 1.7 / height])
    cmap = colormaps["viridis"].with_extremes(bad=_hex(_NONFINITE_COLOR))
    finite = np.where(np.isfinite(logs), logs, np.nan)
    mesh = axes.pcolormesh(
        column_edges(steps),
        np.arange(n_layers + 1) - 0.5,
        np.ma.masked_invalid(finite),
        cmap=cmap,
        vmin=low,
        vmax=high,
        shading="flat",
    )
    zero = np.where(columns.T == 0.0, 1.0, np.nan)
    if np.isfinite(zero).any():
        axes.pcolormesh(
            column_edges(steps),
            np.arange(n_layers + 1) - 0.5,
            np.ma.masked_invalid(zero),
            cmap=_flat(_ZERO_COLOR),
            shading="flat",
        )
    axes.set_ylim(n_layers - 0.5, -0.5)  # forward order from the top
    axes.set_yticks(range(n_layers))
    labels = [f"{i} {layer}" for i, layer in enumerate(layers)]
    axes.set_yticklabels(labels, fontsize=9)
    axes.set_xlabel("training step")
    axes.set_title(title, fontsize=11, pad=16)
    last = columns[-1]
    # Plain texts, not a secondary axis: a third of the drawing time less.
    transform = axes.get_yaxis_transform()  # x in axes, y in data units
    for row, value in enumerate(last):
        axes.text(1.01, row, _short(value), transform=transform, fontsize=8, va="center")
    axes.text(1.01, -0.5, f"last (step {steps[-1]})", transform=transform, fontsize=8, va="bottom")
    bar_axes = figure.add_axes([0.9, 1.0 / height, 0.02, 1.0 - 1.7 / height])
    bar = figure.colorbar(mesh, cax=bar_axes, extend="both")
    bar.set_label("log10 norm (5th-95th percentile; beyond: end colors)", fontsize=8)
    handles = [
        Patch(color=_hex(_NONFINITE_COLOR), label="NaN or inf"),
        Patch(color=_hex(_ZERO_COLOR), label="zero"),
    ]
    found = first_nonfinite(columns, steps)
    if found is not None:
        step, layer = found
        edges = column_edges(steps)
        start = edges[list(steps).index(step)]  # where that column begins
        axes.axvline(start, color="black", linestyle="--", linewidth=1.5)
        axes.annotate(
            f"NaN/inf from step {step}",
            xy=(start, -0.5),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
            color="#b00000",
            fontweight="bold",
            annotation_clip=False,
        )
        handles.append(
            Patch(
                color="white",
                label=f"first NaN/inf: step {step}, layer {layer} {layers[layer]}",
            )
        )
    figure.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.2, 0.08 / height),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    figure.canvas.draw()
    rgba = np.asarray(figure.canvas.buffer_rgba())
    return rgba[None, :, :, :3].copy()


def _hex(rgb):
    return "#%02x%02x%02x" % tuple(rgb)


def _flat(rgb):
    from matplotlib.colors import ListedColormap

    return ListedColormap([_hex(rgb)])


def _short(value):
    if not np.isfinite(value):
        return "NaN/inf"
    return "0" if value == 0 else f"{value:.2g}"
