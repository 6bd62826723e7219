"""TensorBoard pieces of `GradientTensorBoard`: tags, layout, buffered scalars.

Every tag starts with `gradients/`, so TensorBoard's dashboards show them
in one section; the second component keeps the kinds apart (a layer named
`log10_global_norm` cannot collide with the global norm). Per-layer tags
are named by the layer's path alone, so that the same layer has the same
tag in every run; forward order lives in the custom-scalars layout.

TensorFlow writes the events on every backend; it is imported where they
are written, so that `GradientMonitor` (which flushes the writers here)
loads it on JAX and PyTorch only if a TensorBoard callback wrote.
"""

import re
import time
import weakref

import numpy as np

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


def log10_histogram_tag(path):
    return path + LOG10_HISTOGRAM_SUFFIX


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
    `metrics.compiled.tensorboard_charts`) go in a category of their own,
    "Training dynamics", if any. Must run under a default summary writer.
    Returns False (and writes nothing) if the TensorBoard package is missing.
    """
    import tensorflow as tf

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
_ROWS_FUNCTION = []  # the concrete function, once traced, for every writer


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


def _varint(n):
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number, payload):
    """A length-delimited protobuf field (`number` < 16)."""
    return bytes([number << 3 | 2]) + _varint(len(payload)) + payload


# A float32 scalar `TensorProto` up to its value, as `tf.summary.scalar`
# writes it: dtype DT_FLOAT (field 1 = 1), an empty shape (field 2),
# `float_val` (field 5) packed, 4 bytes.
_FLOAT_HEAD = b"\x08\x01\x12\x00\x2a\x04"


def _value_head(tag, metadata):
    """A `Summary`'s `value` entry for `tag`, all but its 4 float bytes.

    `Summary.Value`: `tag` (field 1), `tensor` (field 8), `metadata`
    (field 9) if any; the tensor goes last, so that its float ends it.
    """
    inner = _field(1, tag.encode()) + (_field(9, metadata) if metadata else b"")
    inner += bytes([8 << 3 | 2]) + _varint(len(_FLOAT_HEAD) + 4) + _FLOAT_HEAD
    return bytes([1 << 3 | 2]) + _varint(len(inner) + 4) + inner


def _rows_function():
    """A concrete function writing serialized `Summary` protos at steps.

    Its arguments: the writer's resource handle, the `[rows]` steps and the
    `[rows]` protos. One event per row, holding all of its values (an
    event per value, as `tf.summary.scalar` writes, repeats the wall time,
    the step and the record framing for each). It writes with
    `WriteRawProtoSummary` on the handle, without `record_if` (Keras sets
    one that counts executions).
    """
    import tensorflow as tf

    if _ROWS_FUNCTION:
        return _ROWS_FUNCTION[0]
    gen_summary_ops = _compat.summary_ops()  # no public op taking a handle

    def write_rows(resource, steps, protos):
        def body(j):
            gen_summary_ops.write_raw_proto_summary(resource, steps[j], protos[j])
            return (j + 1,)

        return tf.while_loop(lambda j: j < tf.shape(steps)[0], body, (tf.constant(0),))

    function = tf.function(write_rows, autograph=False).get_concrete_function(
        tf.TensorSpec([], tf.resource),
        tf.TensorSpec([None], tf.int64),
        tf.TensorSpec([None], tf.string),
    )
    _ROWS_FUNCTION.append(function)
    return function


def flush_all():
    """Writes every buffered row, e.g. before an error ends `fit` (which
    then calls no `on_train_end`). A writer that fails is skipped."""
    writers = list(_WRITERS)
    if not writers:
        return  # nothing was written: TensorFlow need not be loaded
    import tensorflow as tf

    for writer in writers:
        try:
            writer.flush()
        except (tf.errors.OpError, OSError):
            pass


class ScalarWriter:
    """Writes a fixed list of scalar tags, one value each per step.

    Each step's values go into one event (a `Summary` of one float32
    scalar `tf.summary.scalar` would write per tag, serialized here), and
    each tag's summary metadata (the scalar plugin's, with its description)
    only with its first value, as TensorBoard reads it: a value costs its
    tag and about 14 bytes, where an event of its own costs about 30 more.
    With `traced=True` the rows are buffered and written in bulk by one
    concrete `tf.function` (traced once per process, for every writer):
    for frequent writes.
    The buffer is written once it holds `max_rows` rows or its first row is
    `max_seconds` old, and on `flush()` (at each epoch end and before the
    writer closes), so TensorBoard, which reloads every few seconds,
    shows the steps about as soon as without buffering. The steps are
    tensors, so they are not frozen at trace time, and the writes ignore
    the `record_if` condition Keras's TensorBoard sets for an integer
    `update_freq` (it counts executions, not batches), as eager writes
    (`traced=False`, one op per row) do.

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
        self._first_heads = [
            _value_head(tag, _scalar_metadata(d)) for tag, d in zip(self.tags, descriptions)
        ]
        self._heads = [_value_head(tag, None) for tag in self.tags]
        self._described = False  # whether the first row (with metadata) is out
        self._rows = []
        self._steps = []
        self._since = None

    def _proto(self, values):
        """One row as a serialized `Summary`."""
        heads = self._heads
        if not self._described:
            self._described = True
            heads = self._first_heads
        raw = np.asarray(values, dtype="<f4").tobytes()
        return b"".join(head + raw[4 * i : 4 * i + 4] for i, head in enumerate(heads))

    def write(self, step, values, now=False):
        """Adds one step's values; `now=True` writes the buffer at once."""
        import tensorflow as tf

        proto = self._proto(values)
        if not self.traced:
            _compat.summary_ops().write_raw_proto_summary(
                _writer_resource(self.writer), tf.constant(step, tf.int64), tf.constant(proto)
            )
            return
        if self._since is None:
            self._since = time.monotonic()
        self._rows.append(proto)
        self._steps.append(step)
        if (
            now
            or len(self._rows) >= self.max_rows
            or time.monotonic() - self._since >= self.max_seconds
        ):
            self.flush()

    def flush(self):
        """Writes the buffered rows (to the writer, not yet to the file)."""
        import tensorflow as tf

        if not self._rows:
            return
        rows, steps = self._rows, np.asarray(self._steps, np.int64)
        self._rows, self._steps, self._since = [], [], None
        _rows_function()(
            _writer_resource(self.writer), tf.constant(steps), tf.constant(rows, tf.string)
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
    import tensorflow as tf

    values = tf.reshape(values, [-1])
    bad = tf.boolean_mask(values, ~tf.math.is_finite(values))
    return tf.where(tf.math.is_nan(bad), 0.0, tf.sign(tf.cast(bad, tf.float32)))
