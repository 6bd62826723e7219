"""TensorBoard pieces of `GradientTensorBoard`: tags, layout, buffered scalars.

Every tag starts with `gradients/`, so TensorBoard's dashboards show them
in one section; the second component keeps the kinds apart (a layer named
`global_norm` cannot collide with the global norm).
"""

import re
import time
import weakref

import numpy as np
import tensorflow as tf

from keras_keepgrad import _compat

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
    "fewer), and shows their geometric mean. Colors: viridis on one fixed "
    "scale, the same in every run, from 1e-8 to 1e4; values beyond are drawn "
    "in the end colors, hatched. The color bar marks the vanishing (1e-5) "
    "and exploding (1e3) thresholds of GradientMonitor and GradientReport. "
    "Black: a zero norm; red: NaN or inf, and a red dashed line with its "
    "step marks the first non-finite step. The right-hand labels give each "
    "layer's norm in the last column."
)

HISTOGRAM_SUFFIX = "/gradient"
NONFINITE_HISTOGRAM_SUFFIX = "/gradient_nonfinite"
LOG10_HISTOGRAM_SUFFIX = "/gradient_log10_abs"

HISTOGRAM_DESCRIPTION = (
    "The finite entries of this variable's kept gradient, beside the "
    "variable's weights (`.../histogram`). A step whose entries were all "
    "NaN or inf has no values here: see `.../gradient_nonfinite`."
)
LOG10_HISTOGRAM_DESCRIPTION = (
    "log10 of the magnitude of this variable's finite, non-zero gradient "
    "entries: -6 reads 1e-6. Where `.../gradient` spans a tiny range (a "
    "vanishing layer's entries of about 1e-7), TensorBoard labels its axis "
    "with long fixed-point numbers that overlap; here the axis reads in "
    "decades, comparable with the heatmap and the log10_grad_norm charts."
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


def log10_histogram_tag(path):
    return path + LOG10_HISTOGRAM_SUFFIX


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
    gen_summary_ops = _compat.summary_ops()  # no public op taking a handle

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
