"""`GradientReport`: a per-layer gradient health table at the end of `fit`.

Conventions for steps and layers: see `keras_keepgrad.callbacks`.
"""

import html
import math
import os

import keras
import numpy as np

from keras_keepgrad import _checks
from keras_keepgrad.callbacks import _health
from keras_keepgrad.callbacks import _reading

__all__ = ["GradientReport"]

_COLUMNS = (
    "layer",
    "mean norm",
    "min",
    "max",
    "last",
    "non-finite",
    f"steps < {_health.VANISHING_THRESHOLD:g}",
    "verdict",
)
_VERDICT_COLORS = {
    "ok": "#1a7f37",
    "vanishing": "#0b5cad",
    "exploding": "#c2410c",
    "non-finite": "#b00000",
}


class GradientReport(_reading.KeptStepReader):
    """Sums up each layer's gradient norms over a `fit`, with a verdict.

    After every training batch it reads each layer's gradient L2 norm (the
    statistics the training step recorded, as `GradientMonitor` does); at
    the end of `fit` it prints one row per layer, in forward order: the
    mean, smallest, largest and last norm over the finite steps, how many
    steps were not finite, how many were below `VANISHING_THRESHOLD` (1e-5),
    and a verdict:

    - `"non-finite"`: at least one step's gradients held NaN or inf;
    - `"vanishing"`: the mean norm is below `VANISHING_THRESHOLD` (1e-5);
    - `"exploding"`: the mean norm is above `EXPLODING_THRESHOLD` (1e3);
    - `"ok"` otherwise.

    The thresholds are `GradientMonitor`'s defaults and the marks on
    `GradientTensorBoard`'s heatmap color bar. The table is printed with
    `rich` where it is installed (Keras installs it), else as plain text.
    It can also be saved as a PNG figure (each layer's range of norms on a
    log scale, with the vanishing and exploding zones shaded) and as a
    self-contained HTML page (the table, with the same range bars drawn
    inline; no script, no external file).

    Args:
        print_table: Bool. Print the table at the end of `fit`. Defaults to
            `True`.
        png: Str, path or None. Write the figure there at the end of `fit`.
            Defaults to `None`.
        html: Str, path or None. Write the HTML page there at the end of
            `fit`. Defaults to `None`.
        title: Str or None. The heading of the table, figure and page;
            None names the model. Defaults to `None`.

    Attributes:
        rows: List of dicts, one per layer in forward order, after `fit`:
            `layer`, `steps` (steps read), `mean`, `min`, `max`, `last`
            (floats, over the finite steps; NaN if there were none),
            `nonfinite` and `vanishing_steps` (ints) and `verdict`.
        backend: Str. The Keras backend the report was made on.
        skipped_steps: Int. How many of the steps read `skip_bad_steps`
            skipped (as `fit` logs them); the heading says so
            when there were any. Their norms count like any other step's:
            the report describes the gradients, whether the update ran or
            not (`GradientTensorBoard`'s non-finite count does the same).

    Raises:
        ValueError: On an invalid argument; when the model was built with
            `keep_gradients=False` (at the start of `fit`).
        TypeError: The model is not a `KeepGradModel` (at the start of `fit`).

    Examples:
        ```python
        report = kg.callbacks.GradientReport(html="gradients.html")
        model.fit(x, y, epochs=3, callbacks=[report])
        # layer    mean norm  min        max   ...  verdict
        # dense_0  3.182e-06  2.821e-06  ...        vanishing
        report.rows[0]["verdict"]   # 'vanishing'
        ```
    """

    _callback_name = "GradientReport"

    def __init__(
        self,
        print_table: bool = True,
        png: str | os.PathLike | None = None,
        html: str | os.PathLike | None = None,
        title: str | None = None,
    ) -> None:
        super().__init__()
        self.print_table = _checks.check_bool("print_table", print_table)
        self.png = _path_or_none("png", png)
        self.html = _path_or_none("html", html)
        if title is not None and not isinstance(title, str):
            raise TypeError(
                f"`title` must be a str or None. Received: title={title!r} "
                f"of type {type(title).__name__}"
            )
        self.title = title
        self.rows = []
        self.backend = keras.backend.backend()
        self.skipped_steps = 0

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._start()
        self.backend = keras.backend.backend()
        self.rows = []

    def _start(self):
        n = len(self._norms.layers)
        self._count = np.zeros(n, np.int64)  # finite steps
        self._sum = np.zeros(n)
        self._min = np.full(n, np.inf)
        self._max = np.full(n, -np.inf)
        self._last = np.full(n, np.nan)
        self._nonfinite = np.zeros(n, np.int64)
        self._vanishing = np.zeros(n, np.int64)
        self._read = 0
        self.skipped_steps = 0

    def _on_layers_changed(self):
        self._start()  # the step kept other layers than it trains

    def _on_kept_step(self, step, epoch, norms):
        values = np.asarray(norms.layer_norms, np.float64)
        finite = np.isfinite(values) & ~np.asarray(norms.layer_nonfinite, bool)
        self._read += 1
        self.skipped_steps += bool(self._was_skipped(step, norms))
        self._nonfinite += ~finite
        self._count += finite
        self._sum += np.where(finite, values, 0.0)
        self._min = np.where(finite, np.minimum(self._min, values), self._min)
        self._max = np.where(finite, np.maximum(self._max, values), self._max)
        self._last = np.where(finite, values, self._last)
        self._vanishing += finite & (values < _health.VANISHING_THRESHOLD)

    def on_train_end(self, logs=None):
        self.rows = self._rows()
        if self.print_table:
            self.show()
        if self.png is not None:
            self.save_png(self.png)
        if self.html is not None:
            self.save_html(self.html)

    def _rows(self):
        rows = []
        for i, layer in enumerate(self._norms.layers):
            count = int(self._count[i])
            mean = float(self._sum[i] / count) if count else math.nan
            rows.append(
                {
                    "layer": layer,
                    "steps": self._read,
                    "mean": mean,
                    "min": float(self._min[i]) if count else math.nan,
                    "max": float(self._max[i]) if count else math.nan,
                    "last": float(self._last[i]),
                    "nonfinite": int(self._nonfinite[i]),
                    "vanishing_steps": int(self._vanishing[i]),
                    "verdict": _health.verdict(mean, int(self._nonfinite[i])),
                }
            )
        return rows

    def _title(self):
        if self.title is not None:
            return self.title
        name = getattr(self.model, "name", None) or "model"
        return f"Gradient health of {name}"

    def _subtitle(self):
        steps = self.rows[0]["steps"] if self.rows else 0
        skipped = f" ({self.skipped_steps} skipped)" if self.skipped_steps else ""
        return (
            f"{steps} training steps read{skipped}, backend {self.backend}; vanishing: mean "
            f"norm < {_health.VANISHING_THRESHOLD:g}, exploding: > "
            f"{_health.EXPLODING_THRESHOLD:g}"
        )

    def show(self):
        """Prints the table of the last `fit` (with `rich` if installed)."""
        print_table(self.rows, self._title(), self._subtitle())

    def table(self):
        """The table of the last `fit`, as plain text."""
        return plain_table(self.rows)

    def save_png(self, path):
        """Writes the figure of the last `fit` as a PNG file at `path`."""
        _checks.check_writable_dir(os.path.dirname(os.path.abspath(path)), "png", path)
        figure = render_figure(self.rows, self._title(), self._subtitle())
        figure.savefig(os.fspath(path), format="png", dpi=100)

    def save_html(self, path):
        """Writes the self-contained HTML page of the last `fit` at `path`."""
        _checks.check_writable_dir(os.path.dirname(os.path.abspath(path)), "html", path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(render_html(self.rows, self._title(), self._subtitle()))


def _path_or_none(name, value):
    if value is None or isinstance(value, (str, os.PathLike)):
        return value
    raise TypeError(
        f"`{name}` must be a file path (str or os.PathLike) or None. Received: "
        f"{name}={value!r} of type {type(value).__name__}"
    )


def _number(value):
    return "-" if not math.isfinite(value) else f"{value:.3e}"


def _cells(row):
    return (
        row["layer"],
        _number(row["mean"]),
        _number(row["min"]),
        _number(row["max"]),
        _number(row["last"]),
        str(row["nonfinite"]),
        f"{row['vanishing_steps']}/{row['steps']}",
        row["verdict"],
    )


def plain_table(rows):
    """The rows as a plain-text table (columns padded, a rule under the head)."""
    lines = [_COLUMNS] + [_cells(row) for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(_COLUMNS))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def print_table(rows, title, subtitle):
    """Prints the table with `rich` if it is installed, else as plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"{title}\n{subtitle}\n{plain_table(rows)}")
        return
    table = Table(title=f"{title}\n{subtitle}", title_justify="left")
    for i, column in enumerate(_COLUMNS):
        table.add_column(column, justify="left" if i in (0, 7) else "right", no_wrap=True)
    for row in rows:
        cells = list(_cells(row))
        color = _VERDICT_COLORS[row["verdict"]]
        cells[-1] = f"[bold {color}]{cells[-1]}[/]"
        table.add_row(*cells)
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a pipe or a file: no wrapping
    console.print(table)


def _position(value, low, high):
    """`value`'s place on the log10 scale from `low` to `high`, in [0, 1]."""
    if not (math.isfinite(value) and value > 0):
        return 0.0 if value == 0 else math.nan
    return min(max((math.log10(value) - low) / (high - low), 0.0), 1.0)


def render_figure(rows, title, subtitle):
    """Each layer's min-max range, mean and last norm on one log10 axis.

    A `matplotlib.figure.Figure` (Agg canvas, no `pyplot`): one row per
    layer in forward order, the heatmap's fixed scale 1e-8 to 1e4, the
    vanishing and exploding zones shaded, the verdict beside each row.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    low, high = _health.LOG10_RANGE
    n = max(len(rows), 1)
    names = [f"{i} {row['layer']}" for i, row in enumerate(rows)]
    longest = max((len(name) for name in names), default=5)
    row_height = 0.3
    height = 1.4 + row_height * n
    width = 11.0
    left = min(0.1 + longest * 0.085, 4.0) / width
    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_axes([left, 0.75 / height, 0.8 - left, 1.0 - 1.35 / height])
    vanishing = _health.VANISHING_THRESHOLD
    exploding = _health.EXPLODING_THRESHOLD
    axes.axvspan(10.0**low, vanishing, color="#dbe9f7", zorder=0)
    axes.axvspan(exploding, 10.0**high, color="#fde2d2", zorder=0)
    for value in (vanishing, exploding):
        axes.axvline(value, color="#777777", linewidth=1, linestyle="--", zorder=1)
    for y, row in enumerate(rows):
        color = _VERDICT_COLORS[row["verdict"]]
        if math.isfinite(row["min"]):
            lo = min(max(row["min"], 10.0**low), 10.0**high)
            hi = min(max(row["max"], 10.0**low), 10.0**high)
            axes.plot([lo, hi], [y, y], color=color, linewidth=4, alpha=0.45, zorder=2)
            mean = min(max(row["mean"], 10.0**low), 10.0**high)
            axes.plot([mean], [y], "o", color=color, markersize=7, zorder=3)
        if math.isfinite(row["last"]) and row["last"] > 0:
            last = min(max(row["last"], 10.0**low), 10.0**high)
            axes.plot([last], [y], "|", color="black", markersize=12, zorder=4)
        axes.text(
            1.01,
            y,
            row["verdict"],
            transform=axes.get_yaxis_transform(),
            va="center",
            fontsize=10,
            color=color,
            fontweight="bold",
        )
    axes.set_xscale("log")
    axes.set_xlim(10.0**low, 10.0**high)
    axes.set_ylim(n - 0.5, -0.5)
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels(names, fontsize=10)
    axes.set_xlabel("gradient L2 norm: range (bar), mean (dot), last step (tick)", fontsize=10)
    axes.grid(axis="x", color="#dddddd", linewidth=0.6, zorder=0)
    if n > 20:  # a tall figure: the scale at its top too
        axes.tick_params(axis="x", top=True, labeltop=True)
    # The zones' names inside them, along the bottom edge.
    for x, name, align in ((10.0**low, "vanishing", "left"), (10.0**high, "exploding", "right")):
        axes.text(
            x,
            0.01,
            f" {name} ",
            transform=axes.get_xaxis_transform(),
            fontsize=9,
            color=_VERDICT_COLORS[name],
            ha=align,
            va="bottom",
        )
    figure.text(0.01, 1.0 - 0.12 / height, title, fontsize=13, fontweight="bold", va="top")
    figure.text(0.01, 1.0 - 0.42 / height, subtitle, fontsize=9.5, color="#444444", va="top")
    return figure


def _range_svg(row, width=200, height=16):
    """An inline SVG of a row's norms on the fixed log10 scale."""
    low, high = _health.LOG10_RANGE
    color = _VERDICT_COLORS[row["verdict"]]
    x = lambda value: _position(value, low, high) * width  # noqa: E731
    parts = [
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">',
        f'<rect x="0" y="0" width="{x(_health.VANISHING_THRESHOLD):.1f}" '
        f'height="{height}" fill="#dbe9f7"/>',
        f'<rect x="{x(_health.EXPLODING_THRESHOLD):.1f}" y="0" '
        f'width="{width - x(_health.EXPLODING_THRESHOLD):.1f}" height="{height}" '
        f'fill="#fde2d2"/>',
    ]
    if math.isfinite(row["min"]):
        lo, hi, mean = x(row["min"]), x(row["max"]), x(row["mean"])
        if not math.isfinite(lo):  # a zero norm: the scale's left end
            lo = 0.0
        parts.append(
            f'<rect x="{lo:.1f}" y="{height / 2 - 3:.1f}" width="{max(hi - lo, 2):.1f}" '
            f'height="6" rx="3" fill="{color}" fill-opacity="0.45"/>'
        )
        if math.isfinite(mean):
            parts.append(f'<circle cx="{mean:.1f}" cy="{height / 2}" r="4.5" fill="{color}"/>')
    parts.append(
        f"<title>min {_number(row['min'])}, mean {_number(row['mean'])}, "
        f"max {_number(row['max'])}</title></svg>"
    )
    return "".join(parts)


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1f2328}
h1{font-size:20px;margin:0 0 4px}p.sub{color:#57606a;margin:0 0 12px;font-size:13px}
.counts span{display:inline-block;margin:0 8px 12px 0;padding:3px 10px;border-radius:12px;
color:#fff;font-size:13px;font-weight:600}
table{border-collapse:collapse;font-size:13px}
th{text-align:right;border-bottom:2px solid #d0d7de;padding:4px 8px;white-space:nowrap}
td{text-align:right;padding:3px 8px;border-bottom:1px solid #eaeef2;white-space:nowrap;
font-variant-numeric:tabular-nums}
td.layer,th.layer{text-align:left;font-family:ui-monospace,Menlo,Consolas,monospace}
tr.vanishing td{background:#f1f7fd}tr.exploding td{background:#fff4ee}
tr.non-finite td{background:#fdeeee}
td.verdict,th.verdict{text-align:left;font-weight:700}.scale{font-size:11px;color:#57606a}
"""


def render_html(rows, title, subtitle):
    """The table as a self-contained HTML page (inline CSS and SVG)."""
    low, high = _health.LOG10_RANGE
    counts = {}
    for row in rows:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    badges = "".join(
        f'<span style="background:{color}">{counts[verdict]} {verdict}</span>'
        for verdict, color in _VERDICT_COLORS.items()
        if verdict in counts
    )
    # The verdict and the picture first: a wide page still shows them.
    head = (
        '<th>#</th><th class="layer">layer</th><th class="verdict">verdict</th>'
        f'<th>norms on a log scale<br><span class="scale">1e{low:g} \u2026 1e{high:g}; '
        "shaded: vanishing, exploding</span></th>"
        + "".join(f"<th>{html.escape(column)}</th>" for column in _COLUMNS[1:7])
    )
    body = []
    for i, row in enumerate(rows):
        cells = _cells(row)
        color = _VERDICT_COLORS[row["verdict"]]
        body.append(
            f'<tr class="{row["verdict"]}"><td>{i}</td>'
            f'<td class="layer">{html.escape(cells[0])}</td>'
            f'<td class="verdict" style="color:{color}">{html.escape(row["verdict"])}</td>'
            f"<td>{_range_svg(row)}</td>"
            + "".join(f"<td>{html.escape(c)}</td>" for c in cells[1:7])
            + "</tr>"
        )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f'<h1>{html.escape(title)}</h1><p class="sub">{html.escape(subtitle)}</p>'
        f'<div class="counts">{badges}</div>'
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        "</body></html>\n"
    )
