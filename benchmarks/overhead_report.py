"""`overhead.py`'s results as Markdown tables."""

import os
import platform
import subprocess

import keras
import numpy as np
import tensorflow as tf

import keras_keepgrad as kg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_state():
    """The commit benchmarked, and whether the package differs from it."""

    def git(*args):
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    return {
        "commit": git("rev-parse", "HEAD"),
        "package_changes": git("status", "--porcelain", "--", "keras_keepgrad"),
        "keras_keepgrad": kg.__version__,
    }


def machine_state():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg": list(os.getloadavg()),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "platform": platform.platform(),
    }


def _pct(value):
    return f"{value * 100:+.1f}%"


def _iqr(s):
    return f"{_pct(s['median'])} [{_pct(s['q25'])}, {_pct(s['q75'])}]"


_TITLES = {
    "kept": "kept",
    "every10": "kept, keep_every=10",
    "hand": "hand-written train_step",
    "floor": "floor (one weight copy)",
    "recompute": "recompute in callback",
}


def _timing_table(results, seconds_key, ratio_key, beyond_key, intervals_key, floor_key):
    shown = [v for v in results["variants"] if v in _TITLES]
    floor = "kept" in shown and "floor" in shown
    lines = [
        "| model | params | batch | jit | plain ms/step | control | "
        + " | ".join(_TITLES[v] for v in shown)
        + (" | kept beyond floor [90% interval]" if floor else "")
        + " | recompute / kept (5th pct.) | kept: 90% interval | target |",
        "|---" * (9 + len(shown) + floor) + "|",
    ]
    for r in results["configs"]:
        beyond = r[beyond_key]
        kept = beyond["kept"]["median"] if "kept" in beyond else None
        factor = ""
        if kept is not None and "recompute" in beyond:
            recompute = beyond["recompute"]["median"]
            factor = f"{recompute / kept:.0f}x" if kept > 0 else "inf (kept <= control)"
        found = r.get(intervals_key) or {}
        if factor and found.get("recompute_over_kept_low") is not None:
            factor += f" ({found['recompute_over_kept_low']:.0f}x)"
        interval = ""
        if "kept" in found.get("ci90", {}):
            low, high = found["ci90"]["kept"]
            interval = f"{_pct(low)} to {_pct(high)}"
        target = ""
        if kept is not None and r["target"] is not None:
            met = "met" if kept <= r["target"] else "MISSED"
            target = f"<= {r['target'] * 100:.0f}%: median {met}"
            if found.get("target_verdict"):
                target += f", interval: {found['target_verdict']}"
        beyond_floor = ""
        if floor:
            beyond_floor = f" | {_pct(r[floor_key]['median'])}"
            if found.get("kept_beyond_floor_ci90"):
                low, high = found["kept_beyond_floor_ci90"]
                beyond_floor += f" [{_pct(low)}, {_pct(high)}]"
        control = {k: v - 1 for k, v in r[ratio_key]["control"].items()}
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['batch_size']} | "
            f"{'on' if r['jit_compile'] else 'off'} | "
            f"{np.median(r[seconds_key]['plain']) * 1e3:.2f} | "
            f"{_iqr(control)} | "
            + " | ".join(_iqr(beyond[v]) for v in shown)
            + beyond_floor
            + f" | {factor} | {interval} | {target} |"
        )
    return lines


def markdown(results):
    """The results as Markdown tables."""
    lines = []
    if results["configs"]:
        lines += ["Wall time:", ""]
        lines += _timing_table(
            results,
            "seconds_per_step",
            "ratio",
            "beyond_control",
            "wall_intervals",
            "kept_beyond_floor",
        )
        lines += ["", "Process CPU time (all threads):", ""]
        lines += _timing_table(
            results,
            "cpu_seconds_per_step",
            "cpu_ratio",
            "cpu_beyond_control",
            "cpu_intervals",
            "cpu_kept_beyond_floor",
        )
        lines += [
            "",
            "Cells: median over rounds [interquartile range]. `control`: the "
            "second plain model's time over plain's, minus 1. Other columns: "
            "overhead beyond the control, the median of per-round "
            "`time(variant) / time(plain) - time(control) / time(plain)`. "
            "Interval: a bootstrap 90% interval of kept's median (rounds and, "
            "with several instances, model objects resampled; with several "
            "processes, the processes first); recompute / "
            "kept in parentheses: the bootstrap's 5th percentile. Target "
            "verdict by interval: met (all of it within the target), missed "
            "(all of it beyond), undecided (it spans the target). Kept beyond "
            "floor: the median of per-round `(time(kept) - time(floor)) / "
            "time(plain)`, with its bootstrap 90% interval.",
        ]
    runs = [c for c in results["configs"] if "per_process" in c]
    if runs:
        lines += [
            "",
            "Each process alone (`--processes`), kept beyond the control, "
            "wall time, median [its 90% interval]:",
            "",
        ]
        for c in runs:
            cells = []
            for p in c["per_process"]:
                kept = p["kept_beyond_control"]
                cell = "?" if kept is None else _pct(kept["median"])
                if p["kept_ci90"]:
                    cell += f" [{_pct(p['kept_ci90'][0])}, {_pct(p['kept_ci90'][1])}]"
                cells.append(cell)
            lines.append(
                f"- {c['model']}, jit {'on' if c['jit_compile'] else 'off'}: " + ", ".join(cells)
            )
    if results.get("op_counts"):
        lines += [
            "",
            "| model | plain ops | keep_gradients=False ops | kept ops | "
            "off == plain | extra ops when kept |",
            "|---|---|---|---|---|---|",
        ]
        for o in results["op_counts"]:
            extra = ", ".join(f"{k} x{v}" for k, v in o["kept_extra_ops"].items())
            lines.append(
                f"| {o['model']} | {o['plain']} | {o['off']} | {o['kept']} | "
                f"{'yes' if o['off_equals_plain'] else 'NO'} | {extra} |"
            )
    if results.get("memory"):
        lines += [
            "",
            "| model | malloc | parameter MB | peak RSS MB, plain | kept | extra | "
            "growth in training MB, plain | kept | extra |",
            "|---|---|---|---|---|---|---|---|---|",
        ]

        def cells(values, extra):
            def fmt(xs):
                return ", ".join("?" if x is None else f"{x:.0f}" for x in xs)

            extra = "?" if extra is None else f"{extra:+.1f}"
            return f"{fmt(values['plain'])} | {fmt(values['kept'])} | {extra}"

        for m in results["memory"]:
            lines.append(
                f"| {m['model']} | {m['allocator']} | {m['param_mb']:.1f} | "
                f"{cells(m['peak_rss_mb'], m['extra_mb'])} | "
                f"{cells(m['training_growth_mb'], m['extra_training_growth_mb'])} |"
            )
        hand = [m for m in results["memory"] if "hand_extra_mb" in m]
        if hand:
            lines += [
                "",
                "Hand-written train_step keeping gradients (slots made "
                "before training), over plain:",
                "",
            ]
            lines += [
                f"- {m['model']} ({m['allocator']} malloc): peak RSS "
                f"{m['hand_extra_mb']:+.1f} MB, growth in training "
                f"{m['hand_extra_training_growth_mb']:+.1f} MB "
                f"(runs: {', '.join(f'{x:.0f}' for x in m['peak_rss_mb']['hand'])} MB)"
                for m in hand
            ]
    return "\n".join(lines)
