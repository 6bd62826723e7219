"""The heatmap of `GradientTensorBoard`: per-layer norms by training step.

`Heatmap` gathers the recorded steps' layer norms into at most a fixed
number of columns; `render_heatmap` draws them as a labelled figure with
matplotlib's Agg canvas (no `pyplot`, no global state).
"""

import numpy as np

from keras_keepgrad.callbacks import _health

__all__ = [
    "Heatmap",
    "color_range",
    "colorize",
    "column_edges",
    "elide",
    "first_nonfinite",
    "labelled_rows",
    "render_heatmap",
]

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

    The log10 norms are spread over viridis on the fixed `color_range()`
    (1e-8 to 1e4), clipped beyond; zeros are black and NaN or inf are red.
    """
    norms = np.asarray(norms, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(norms)
    finite = np.isfinite(logs)
    low, high = color_range()
    position = np.zeros_like(logs)
    position[finite] = np.clip((logs[finite] - low) / (high - low), 0.0, 1.0)
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


def color_range(logs=None):
    """The log10 range the heatmap's colors span: 1e-8 to 1e4.

    Fixed, the same for every run, so that a color always means the same
    norm. Norms beyond are clipped to the end colors (and hatched in the
    figure). `logs` is accepted for compatibility and ignored.

    Returns:
        `(low, high)` floats: `(-8.0, 4.0)`.
    """
    del logs
    return _health.LOG10_RANGE


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


# The figure's size and type, in pixels at 100 dpi. Until "Show actual
# image size" is ticked, TensorBoard's Time Series dashboard shrinks an image
# to fit its card, about 640 x 230 pixels in a 1200 x 900 window: a figure
# of that shape at twice the size (1200 x 440) with 15 pt (21 pixel) text
# is shown at about half size with text of 10 pixels or more, whatever the
# number of layers; rows are then named only as far as they fit (every
# k-th beyond that, with its number).
_DPI = 100
_WIDTH = 1200
_FONT = 15.0  # points
_FONT_PX = _FONT * _DPI / 72.0
_PLOT_HEIGHT = 270
_NAME_CHARS = 32  # longer layer names are elided in the middle


def elide(name, limit=_NAME_CHARS):
    """`name`, with its middle replaced by "…" if longer than `limit`."""
    if len(name) <= limit:
        return name
    head = (limit - 1 + 1) // 2
    tail = limit - 1 - head
    return name[:head] + "\u2026" + name[len(name) - tail :]


def labelled_rows(n_layers, plot_height=None):
    """The rows `render_heatmap` names: all, or every k-th when crowded."""
    if plot_height is None:
        plot_height = _PLOT_HEIGHT
    fit = max(int(plot_height // (1.3 * _FONT_PX)), 1)
    every = -(-n_layers // fit)  # ceil
    return list(range(0, n_layers, every))


def render_heatmap(heatmap, layers, title="Gradient L2 norm per layer"):
    """The heatmap as a labelled figure: `[1, height, width, 3]` uint8.

    Layers on the rows (forward order, numbered, names whole up to 32
    characters, else elided in the middle; with more rows than fit at the
    figure's size, every k-th is named), training steps on the x axis, a
    color bar over the fixed log10 scale `color_range()` (1e-8 to 1e4, the
    same in every run; cells beyond it hatched in the end colors) marked at
    `VANISHING_THRESHOLD` and `EXPLODING_THRESHOLD`, zero norms black and
    NaN or inf red (all named in a legend), a dashed line at the first
    non-finite step, and the named layers' last values on the right.
    1200 x 436 pixels, sized to read in TensorBoard's image card at its
    default size. Drawn with matplotlib's Agg canvas, without `pyplot` (no
    global state).
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    columns = np.stack(heatmap.columns)  # [steps, layers]
    steps = heatmap.steps
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(columns).T  # [layers, steps]
    low, high = color_range()
    n_layers = len(layers)
    rows = labelled_rows(n_layers)
    labels = [f"{i} {elide(str(layers[i]))}" for i in rows]
    plot = _PLOT_HEIGHT
    top, bottom = 66, 110  # title; x axis and legend
    height = top + plot + bottom
    char = 0.6 * _FONT_PX
    left = 14 + char * max(len(label) for label in labels)
    bar_labels = 14 + 0.7 * _FONT_PX * len("1e3 exploding")  # bold
    right = 14 + char * 7 + 22 + bar_labels  # last values, bar, its labels
    figure = Figure(figsize=(_WIDTH / _DPI, height / _DPI), dpi=_DPI)
    FigureCanvasAgg(figure)

    def box(x, width):  # pixels -> figure fractions, rows of the plot
        return [x / _WIDTH, bottom / height, width / _WIDTH, plot / height]

    axes = figure.add_axes(box(left, _WIDTH - left - right))
    cmap = colormaps["viridis"].with_extremes(bad=_hex(_NONFINITE_COLOR))
    finite = np.where(np.isfinite(logs), logs, np.nan)
    edges = column_edges(steps)
    y_edges = np.arange(n_layers + 1) - 0.5
    mesh = axes.pcolormesh(
        edges,
        y_edges,
        np.ma.masked_invalid(finite),
        cmap=cmap,
        vmin=low,
        vmax=high,
        shading="flat",
    )
    zero = np.where(columns.T == 0.0, 1.0, np.nan)
    if np.isfinite(zero).any():
        axes.pcolormesh(
            edges, y_edges, np.ma.masked_invalid(zero), cmap=_flat(_ZERO_COLOR), shading="flat"
        )
    with np.errstate(invalid="ignore"):
        beyond = np.isfinite(logs) & ((logs < low) | (logs > high))
    hatch = dict(facecolor="none", edgecolor="#bbbbbb", hatch="///", linewidth=0.0)
    if beyond.any():
        axes.add_collection(PatchCollection(_runs(beyond, edges), **hatch))
    axes.set_ylim(n_layers - 0.5, -0.5)  # forward order from the top
    axes.set_yticks(rows)
    axes.set_yticklabels(labels, fontsize=_FONT)
    axes.tick_params(axis="x", labelsize=_FONT)
    axes.set_xlabel("training step", fontsize=_FONT)
    figure.text(
        0.5,
        1.0 - 10 / height,
        f"{title}, on one fixed scale: 1e{low:g} to 1e{high:g}",
        ha="center",
        va="top",
        fontsize=_FONT + 1,
    )
    last = columns[-1]
    # Plain texts, not a secondary axis: a third of the drawing time less.
    transform = axes.get_yaxis_transform()  # x in axes, y in data units
    for row in rows:
        axes.text(1.01, row, _short(last[row]), transform=transform, fontsize=_FONT, va="center")
    axes.text(1.01, -0.5, "last", transform=transform, fontsize=_FONT, va="bottom")
    bar_axes = figure.add_axes(box(_WIDTH - 22 - bar_labels, 22))
    bar = figure.colorbar(mesh, cax=bar_axes, extend="both")
    vanishing, exploding = _health.VANISHING_THRESHOLD, _health.EXPLODING_THRESHOLD
    marks = {np.log10(vanishing): "vanishing", np.log10(exploding): "exploding"}
    ticks = sorted({low, -2.0, 0.0, *marks})
    bar.set_ticks(ticks)
    bar.set_ticklabels(
        [f"{_decade(t)} {marks[t]}" if t in marks else _decade(t) for t in ticks],
        fontsize=_FONT,
    )
    for value, name in marks.items():
        bar_axes.axhline(value, color="#d62728" if name == "exploding" else "white", linewidth=2.5)
    for label in bar_axes.get_yticklabels():
        if label.get_text().endswith(("vanishing", "exploding")):
            label.set_fontweight("bold")
    handles = [
        Patch(color=_hex(_NONFINITE_COLOR), label="NaN or inf"),
        Patch(color=_hex(_ZERO_COLOR), label="zero"),
        Patch(facecolor=cmap(0.0), edgecolor="#bbbbbb", hatch="///", label="beyond the scale"),
    ]
    found = first_nonfinite(columns, steps)
    if found is not None:
        step, layer = found
        start = edges[list(steps).index(step)]  # where that column begins
        axes.axvline(start, color="black", linestyle="--", linewidth=2.0)
        axes.annotate(
            f"NaN/inf from step {step}",
            xy=(start, -0.5),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=_FONT,
            color="#b00000",
            fontweight="bold",
            annotation_clip=False,
        )
        figure.text(
            1.0 - 8 / _WIDTH,
            8 / height,
            f"first NaN/inf: step {step}, layer {layer} {elide(layers[layer])}",
            ha="right",
            va="bottom",
            fontsize=_FONT,
            color="#b00000",
        )
    figure.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(8 / _WIDTH, 4 / height),
        ncol=len(handles),
        fontsize=_FONT,
        frameon=False,
        handlelength=1.2,
        columnspacing=1.2,
    )
    figure.canvas.draw()
    rgba = np.asarray(figure.canvas.buffer_rgba())
    return rgba[None, :, :, :3].copy()


def _runs(mask, edges):
    """Rectangles over the runs of True cells of each row of `mask`."""
    from matplotlib.patches import Rectangle

    patches = []
    for row, cells in enumerate(mask):
        padded = np.concatenate([[False], cells, [False]])
        changes = np.flatnonzero(padded[1:] != padded[:-1])
        for begin, end in zip(changes[::2], changes[1::2]):
            patches.append(Rectangle((edges[begin], row - 0.5), edges[end] - edges[begin], 1.0))
    return patches


def _decade(log10_value):
    if -2 <= log10_value <= 2:
        return f"{10.0**log10_value:g}"
    return f"1e{log10_value:g}"


def _hex(rgb):
    return "#%02x%02x%02x" % tuple(rgb)


def _flat(rgb):
    from matplotlib.colors import ListedColormap

    return ListedColormap([_hex(rgb)])


def _short(value):
    if not np.isfinite(value):
        return "NaN/inf"
    return "0" if value == 0 else f"{value:.2g}"
