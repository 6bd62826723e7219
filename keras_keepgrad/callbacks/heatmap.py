"""The heatmap of `GradientTensorBoard`: per-layer norms by training step.

`Heatmap` gathers the recorded steps' layer norms into at most a fixed
number of columns; `render_heatmap` draws them as a labelled figure with
matplotlib's Agg canvas (no `pyplot`, no global state).
"""

import numpy as np

__all__ = [
    "Heatmap",
    "color_range",
    "colorize",
    "column_edges",
    "first_nonfinite",
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
