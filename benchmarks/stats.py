"""The benchmarks' statistics: paired per-round ratios, intervals, verdicts.

A config's timing is one array per process and variant, `[rounds, measures]`
seconds per step (wall, CPU, and for `fit` timings the time in callback
hooks and the event-file bytes). Every variant's time in a round is divided
by the base variant's time in the same round (rounds are paired); its
overhead is the median over rounds of `ratio(variant) - ratio(control)`,
the control being a second base model.
"""

import math
import warnings

import numpy as np
from scipy import stats as scipy_stats

LEVEL = 0.90
RESAMPLES = 2000
# `batch_wall`: wall time without the once-per-epoch figure (see run.py).
TIMES = ("wall", "cpu", "batch_wall")


def quartiles(values):
    q25, median, q75 = np.percentile(np.asarray(values, dtype="float64"), [25, 50, 75])
    return {"median": float(median), "q25": float(q25), "q75": float(q75)}


def median_interval(values, level=LEVEL):
    """A distribution-free interval for the median of `values`.

    From the order statistics: with n values sorted, `[x_(j), x_(n+1-j)]`
    holds the median with probability `1 - 2 P(X < j)`, X binomial(n, 1/2),
    whatever the values' distribution, if they are independent draws of
    one distribution. `j` is the largest whose coverage is at least
    `level`; with too few values for that (under 5 at 90%), the interval is
    `[min, max]` and its coverage less than `level`.

    Returns:
        `{"low", "high", "coverage"}`, floats.
    """
    x = np.sort(np.asarray(values, dtype="float64"))
    n = len(x)
    if n == 0:
        raise ValueError("`values` must not be empty. Received: []")
    j = 1
    below = 1.0 / 2.0**n  # P(X < j)
    while j + 1 <= n - j:
        wider = below + math.comb(n, j) / 2.0**n
        if 1.0 - 2.0 * wider < level:
            break
        j, below = j + 1, wider
    return {"low": float(x[j - 1]), "high": float(x[n - j]), "coverage": 1.0 - 2.0 * below}


def bootstrap_median(groups, level=LEVEL, resamples=RESAMPLES, seed=0):
    """A percentile-bootstrap interval of the median of the pooled `groups`.

    `groups` holds one array of per-round values per process. With one
    process its rounds are drawn (the values are already paired per round,
    so one draw serves every variant alike); with several, whole processes
    are drawn and their rounds pooled: what differs between processes, more
    than rounds within one do, is then in the interval.
    """
    groups = [np.asarray(g, dtype="float64") for g in groups]
    if len(groups) > 1:

        def statistic(index):
            return np.median(np.concatenate([groups[i] for i in index]))

        data, vectorized = (np.arange(len(groups)),), False
    else:
        data, vectorized = (groups[0],), True

        def statistic(x, axis=-1):
            return np.median(x, axis=axis)

    if len(data[0]) < 2 or np.ptp(np.concatenate(groups)) == 0:
        value = float(np.median(np.concatenate(groups)))
        return [value, value]
    with warnings.catch_warnings():
        # A few distinct processes make a degenerate distribution of
        # replicates, which the percentile method handles as it is.
        warnings.simplefilter("ignore", scipy_stats.DegenerateDataWarning)
        found = scipy_stats.bootstrap(
            data,
            statistic,
            vectorized=vectorized,
            n_resamples=resamples,
            confidence_level=level,
            method="percentile",
            random_state=np.random.default_rng(seed),
        )
    return [float(found.confidence_interval.low), float(found.confidence_interval.high)]


def describe(groups):
    """Quartiles of the pooled per-round `groups`, the interval of their
    median, and with several processes each one's median and the
    distribution-free interval of the median of those."""
    out = quartiles(np.concatenate(groups))
    out["ci90"] = bootstrap_median(groups)
    if len(groups) > 1:
        medians = [float(np.median(g)) for g in groups]
        out["process_medians"] = dict(
            values=medians, median=float(np.median(medians)), interval=median_interval(medians)
        )
    return out


def verdict(interval, target):
    """Met when the whole interval is within `target`, missed when all of
    it is beyond, undecided otherwise."""
    low, high = interval
    return "met" if high <= target else "missed" if low > target else "undecided"


def against_floor(interval, tolerance=0.0):
    """Met when the cost beyond the floor reaches down to `tolerance`
    within noise: its interval's low end is at most `tolerance`."""
    return "met" if interval[0] <= tolerance else "missed"


def pass_order(keys, r, p, passes):
    """The order in which pass `p` of round `r` times `keys`.

    A rotation by `r`, plus an offset per pass that spreads a round's passes
    over the rotation: for each pass, over `len(keys)` rounds every key runs
    once at each position, in particular first (right after the round's
    `gc.collect()`, a slow spot), whether `len(keys)` is even or odd.
    """
    n = len(keys)
    shift = (r + p * max(1, n // passes)) % n
    return keys[shift:] + keys[:shift]


def summarize(runs, base, pairs=(), targets=None, tolerance=None, measures=TIMES[:2]):
    """Ratios, overheads, intervals and verdicts of one config.

    Args:
        runs: per process, `{variant: array [rounds, len(measures)]}`.
        base: the variant every ratio divides by; `"control"` must be timed.
        pairs: `(a, b)` pairs, each reported as `(time(a) - time(b)) /
            time(base)` per round (kept beyond the floor, a statistic beyond
            its floor) and as `time(a) / time(b)`.
        targets: `{variant: the most overhead beyond the control it may
            cost}`, or None.
        tolerance: how far beyond its floor (the `b` of its pair) a variant
            may be and still meet its target, or None: not floor-judged.

    Returns:
        A dict; per time measure (`wall`, `cpu`): `ratio`, `beyond_control`
        and `pairs` of `describe`d per-round values, `fastest_ratio`
        (each variant's fastest round over the base's); per other measure,
        its median per step; `verdicts` by wall time, per target.
    """
    runs = [{v: np.asarray(t, dtype="float64") for v, t in run.items()} for run in runs]
    variants = list(runs[0])
    out = {"processes": len(runs), "rounds": sum(len(r[base]) for r in runs)}
    out["step_ms"] = {v: float(np.median(_pooled(runs, v, 0)) * 1e3) for v in variants}
    for m, measure in enumerate(measures):
        if measure not in TIMES:
            out[measure + "_per_step"] = {
                v: float(np.median(_pooled(runs, v, m))) for v in variants
            }
            continue

        def per_round(fn, m=m):
            return [fn({v: t[:, m] for v, t in run.items()}) for run in runs]

        found = {"ratio": {}, "beyond_control": {}, "pairs": {}, "fastest_ratio": {}}
        for v in variants:
            found["ratio"][v] = quartiles(np.concatenate(per_round(lambda t, v=v: t[v] / t[base])))
            found["beyond_control"][v] = describe(
                per_round(lambda t, v=v: (t[v] - t["control"]) / t[base])
            )
            found["fastest_ratio"][v] = float(
                np.min(_pooled(runs, v, m)) / np.min(_pooled(runs, base, m))
            )
        for a, b in pairs:
            found["pairs"][f"{a} - {b}"] = dict(
                describe(per_round(lambda t, a=a, b=b: (t[a] - t[b]) / t[base])),
                ratio=quartiles(np.concatenate(per_round(lambda t, a=a, b=b: t[a] / t[b]))),
            )
        out[measure] = found
    out["verdicts"] = {}
    for subject, target in (targets or {}).items():
        if subject not in variants:
            continue
        found = {
            "target": target,
            "budget": verdict(out["wall"]["beyond_control"][subject]["ci90"], target),
        }
        if "batch_wall" in out:
            found["budget_per_batch"] = verdict(
                out["batch_wall"]["beyond_control"][subject]["ci90"], target
            )
        floor = next((b for a, b in pairs if a == subject), None)
        if tolerance is not None and floor is not None:
            beyond = out["wall"]["pairs"][f"{subject} - {floor}"]["ci90"]
            found.update(
                floor=floor, tolerance=tolerance, against_floor=against_floor(beyond, tolerance)
            )
        out["verdicts"][subject] = found
    return out


def _pooled(runs, variant, m):
    return np.concatenate([run[variant][:, m] for run in runs])
