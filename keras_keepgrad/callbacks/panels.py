"""TensorBoard pieces of `GradientTensorBoard`: tags, layout, buffered scalars.

Every tag starts with `gradients/`, so TensorBoard's dashboards show them
in one section; the second component keeps the kinds apart (a layer named
`log10_global_norm` cannot collide with the global norm). Per-layer tags
are named by the layer's path alone, so that the same layer has the same
tag in every run; forward order lives in the custom-scalars layout.
"""

import re
import time
import weakref

import numpy as np
import tensorflow as tf

from keras_keepgrad import _compat

LAYER_NORM_PREFIX = "gradients/log10_norm/"
GLOBAL_NORM_TAG = "gradients/log10_global_norm"
NONFINITE_TAG = "gradients/nonfinite_steps"
SKIPPED_STEPS_TAG = "gradients/skipped_steps"
LOSS_SCALE_TAG = "gradients/loss_scale"
HEATMAP_TAG = "gradients/heatmap"
LAYOUT_TITLE = "Gradient panels"
BLOCKS_TITLE = LAYOUT_TITLE + ": layers in forward order"
DYNAMICS_TITLE = "Training dynamics"
# Past this many layers, the layout adds charts of at most this many
# consecutive layers each: a chart of more lines has too many similar colors.
BLOCK_SIZE = 16

HEATMAP_DESCRIPTION = (
    "log10 of the L2 gradient norm per layer (rows, forward order from the "
    "top, as in the custom-scalars layout) and training step "
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

LAYER_NORM_DESCRIPTION = (
    "log10 of the L2 norm of this layer's gradients (all its trainable "
    "variables): -6 is 1e-6. NaN (a triangle) where the step's gradients "
    "held NaN or inf; -inf for an all-zero gradient."
)
GLOBAL_NORM_DESCRIPTION = (
    "log10 of the L2 norm over all kept gradients. NaN (a triangle) where "
    "the step's gradients held NaN or inf."
)
NONFINITE_DESCRIPTION = (
    "How many recorded steps of this fit had NaN or inf gradients so far, "
    "as a step function: written at the first recorded step, where it "
    "changes (and at the recorded step before, so the line stays flat up "
    "to the change) and at the last recorded step of each epoch."
)


def layer_norm_tag(layer):
    """`gradients/log10_norm/<layer path>`: the same in every run."""
    return LAYER_NORM_PREFIX + layer


def histogram_tag(path):
    """Beside Keras's `<path>/histogram` of the weights: same category."""
    return path + HISTOGRAM_SUFFIX


def nonfinite_histogram_tag(path):
    return path + NONFINITE_HISTOGRAM_SUFFIX


def layer_blocks(n_layers, size=BLOCK_SIZE):
    """`[(start, stop)]`: consecutive blocks of at most `size` layers.

    None up to `size` layers (the overview chart shows them all); beyond,
    as few blocks as fit, of sizes differing by at most one (17 layers
    make 9 + 8, not 16 + 1).
    """
    if n_layers <= size:
        return []
    count = -(-n_layers // size)
    bounds = [round(i * n_layers / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _exact(tag):
    return "^" + re.escape(tag) + "$"


def write_layout(layers, loss_scaled, count_skipped, dynamics_charts=()):
    """Writes the custom-scalars layout ("gradient panels") at step 0.

    First one chart of the global log10 norm and every layer's, then one of
    the non-finite (and skipped) steps. The overview picks the layers by
    the tag prefix, so its chart is the same in every run: TensorBoard
    merges the layouts of all runs by category title, dropping identical
    charts, and shows all runs' lines in one chart. Its lines come in the
    order the run first wrote the tags: the global norm, then forward
    order (`GradientTensorBoard` writes them so).
    Past `BLOCK_SIZE` layers, a category "Gradient panels: layers in
    forward order" holds charts of consecutive blocks (`layer_blocks`),
    each with the global norm for reference, titled with their positions
    and first and last layers.
    The loss scale has a category of its own, written only under a
    `LossScaleOptimizer` (a run without the optimizer has nothing to show).
    `dynamics_charts` (`[(title, [tag regex, ...])]`, from
    `_dynamics.tensorboard_charts`) go in a category of their own,
    "Training dynamics", if any. Must run under a default summary writer.
    Returns False (and writes nothing) if the TensorBoard package is missing.
    """
    try:
        from tensorboard.plugins.custom_scalar import layout_pb2
        from tensorboard.plugins.custom_scalar import metadata
    except ImportError:
        return False

    def chart(title, patterns):
        return layout_pb2.Chart(
            title=title, multiline=layout_pb2.MultilineChartContent(tag=list(patterns))
        )

    nonfinite = [NONFINITE_TAG] + ([SKIPPED_STEPS_TAG] if count_skipped else [])
    charts = [
        chart(
            "Gradient norm, log10: global, then each layer in forward order",
            [_exact(GLOBAL_NORM_TAG), "^" + re.escape(LAYER_NORM_PREFIX)],
        ),
        chart(
            "Non-finite steps so far"
            + (", and steps skipped by the loss scale" if count_skipped else ""),
            [_exact(tag) for tag in nonfinite],
        ),
    ]
    categories = [layout_pb2.Category(title=LAYOUT_TITLE, chart=charts)]
    blocks = [
        chart(
            f"Layers {start + 1}-{stop} of {len(layers)}: "
            f"{layers[start]} to {layers[stop - 1]}, log10 norm",
            [_exact(GLOBAL_NORM_TAG)] + [_exact(layer_norm_tag(la)) for la in layers[start:stop]],
        )
        for start, stop in layer_blocks(len(layers))
    ]
    if blocks:
        categories.append(layout_pb2.Category(title=BLOCKS_TITLE, chart=blocks))
    if loss_scaled:
        categories.append(
            layout_pb2.Category(
                title=LAYOUT_TITLE + ": loss scale",
                chart=[chart("Loss scale (LossScaleOptimizer)", [_exact(LOSS_SCALE_TAG)])],
            )
        )
    if dynamics_charts:
        dynamics = [chart(title, patterns) for title, patterns in dynamics_charts]
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


def _scalar_metadata(description=None):
    from tensorboard.plugins.scalar import metadata

    return metadata.create_summary_metadata(
        display_name=None, description=description
    ).SerializeToString()


def _rows_function(n_tags):
    """A concrete function writing `[rows, n_tags]` scalars at `[rows]` steps.

    Its arguments: the writer's resource handle, the values, the steps, the
    `[n_tags]` tags and their `[n_tags]` serialized metadata (empty after a
    tag's first row: TensorBoard keeps a tag's first metadata only, as
    `tf.compat.v1.summary.FileWriter` writes it). It writes each value with
    `WriteSummary`, as `tf.summary.write` does but with the tag as given
    (`tf.summary.scalar` would prefix the loop's name scope) and without
    `record_if` (Keras sets one that counts executions).
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
                gen_summary_ops.write_summary(resource, step, row[i], tags[i], metadata[i])
            return (j + 1,)

        return tf.while_loop(lambda j: j < tf.shape(steps)[0], body, (tf.constant(0),))

    function = tf.function(write_rows, autograph=False).get_concrete_function(
        tf.TensorSpec([], tf.resource),
        tf.TensorSpec([None, n_tags], tf.float32),
        tf.TensorSpec([None], tf.int64),
        tf.TensorSpec([n_tags], tf.string),
        tf.TensorSpec([n_tags], tf.string),
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
    as float32, as `tf.summary.scalar` writes them. Each tag's summary
    metadata (the scalar plugin's, with its description) goes with its
    first value only, as TensorBoard reads it: a value costs about half.

    Args:
        writer: The `tf.summary` writer.
        tags: The tags, in the order `write` receives the values.
        traced: Bool. Buffer and write through one `tf.function`.
        max_rows: Int. Write the buffer once it holds this many rows.
        max_seconds: Float. Write it once its first row is this old.
        descriptions: None or one description (Markdown) per tag, shown
            by TensorBoard beside the chart.
    """

    def __init__(self, writer, tags, traced, max_rows=256, max_seconds=1.0, descriptions=None):
        _WRITERS.add(self)
        self.writer = writer
        self.tags = tuple(tags)
        self.traced = traced
        self.max_rows = max_rows
        self.max_seconds = max_seconds
        if descriptions is None:
            descriptions = [None] * len(self.tags)
        self._metadata = [_scalar_metadata(d) for d in descriptions]
        self._described = False  # whether the first row (with metadata) went out
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
        metadata = self._next_metadata()
        with self.writer.as_default(step=step), tf.summary.record_if(True):
            for i, tag in enumerate(self.tags):
                tf.summary.write(tag, tf.constant(values[i], tf.float32), metadata=metadata[i])

    def _next_metadata(self):
        if self._described:
            return [b""] * len(self.tags)
        self._described = True
        return self._metadata

    def flush(self):
        """Writes the buffered rows (to the writer, not yet to the file)."""
        if not self._rows:
            return
        rows, steps = np.stack(self._rows), np.asarray(self._steps, np.int64)
        self._rows, self._steps, self._since = [], [], None
        if self._function is None:
            self._function = _rows_function(len(self.tags))
            self._tag_tensor = tf.constant(self.tags)
            self._no_metadata = tf.constant([b""] * len(self.tags))
        if not self._described:
            self._call(rows[:1], steps[:1], tf.constant(self._next_metadata()))
            rows, steps = rows[1:], steps[1:]
        if len(steps):
            self._call(rows, steps, self._no_metadata)

    def _call(self, rows, steps, metadata):
        self._function(
            _writer_resource(self.writer),
            tf.constant(rows),
            tf.constant(steps),
            self._tag_tensor,
            metadata,
        )


class StepFunctionWriter:
    """Writes one slowly changing scalar (a count) as a step function.

    A stream of equal values says nothing new, so a value is written at the
    first step, where it changes, and by `flush()` (at each epoch end) at
    the last step added. Before a change the last value is also written at
    its own step, if it was not yet: TensorBoard joins points with straight
    lines, so the line stays flat up to the change instead of sloping
    across the steps between.

    Args:
        writer: The `tf.summary` writer.
        tag: The tag.
        traced: Bool. As for `ScalarWriter`.
        description: None or the tag's description.
    """

    def __init__(self, writer, tag, traced, description=None):
        self._scalars = ScalarWriter(writer, [tag], traced=traced, descriptions=[description])
        self._last = None  # (step, value) last added
        self._written_step = None

    def add(self, step, value, now=False):
        """Adds a step's value; `now=True` writes the buffer at once."""
        last, self._last = self._last, (step, value)
        if last is not None and value == last[1]:
            return
        if last is not None and last[0] != self._written_step:
            self._write(*last)
        self._write(step, value, now)

    def _write(self, step, value, now=False):
        self._scalars.write(step, [value], now=now)
        self._written_step = step

    def flush(self):
        """Writes the last step added, then the buffer."""
        if self._last is not None and self._last[0] != self._written_step:
            self._write(*self._last)
        self._scalars.flush()


def nonfinite_kinds(values):
    """float32: -1 for each -inf entry, 0 for each NaN, +1 for each +inf."""
    values = tf.reshape(values, [-1])
    bad = tf.boolean_mask(values, ~tf.math.is_finite(values))
    return tf.where(tf.math.is_nan(bad), 0.0, tf.sign(tf.cast(bad, tf.float32)))
