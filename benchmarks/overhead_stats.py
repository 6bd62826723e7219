"""Statistics of `overhead.py`: per-round ratios, bootstrap intervals, pooling.

A variant's time in a round is divided by the plain model's time in the same
round (rounds are paired); its overhead is the median over rounds of
`ratio(variant) - ratio(control)`, the control being a second plain model.
"""

import json
import math

import numpy as np

# Recomputing the gradients in a callback should cost at least this many
# times what keeping them costs.
RECOMPUTE_FACTOR = 10.0


def quartiles(values):
    q25, median, q75 = np.percentile(np.asarray(values, dtype="float64"), [25, 50, 75])
    return {"median": float(median), "q25": float(q25), "q75": float(q75)}


def median_interval(values, level=0.90):
    """A distribution-free interval for the median of `values`.

    From the order statistics: with n values sorted, `[x_(j), x_(n+1-j)]`
    holds the median with probability `1 - 2 P(X < j)`, X binomial(n, 1/2),
    whatever the values' distribution, if the values are independent draws
    of one distribution. `j` is the largest whose coverage is at least
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


def summarize(times):
    """Per-round ratios against `plain`, and overhead beyond `control`."""
    plain = np.asarray(times["plain"])
    control = np.asarray(times["control"]) / plain
    out = {"ratio": {}, "beyond_control": {}}
    for variant, seconds in times.items():
        ratio = np.asarray(seconds) / plain
        out["ratio"][variant] = quartiles(ratio)
        out["beyond_control"][variant] = quartiles(ratio - control)
    if "kept" in times and "floor" in times:
        out["kept_beyond_floor"] = quartiles(
            (np.asarray(times["kept"]) - np.asarray(times["floor"])) / plain
        )
    return out


BOOTSTRAP_SAMPLES = 2000
KEPT_BEYOND_FLOOR = "kept - floor"


def _instances(fastest, variant="plain"):
    return sum(1 for v, _ in fastest if v == variant)


def bootstrap(runs, variants, seed=0, samples=BOOTSTRAP_SAMPLES):
    """Bootstrap replicates of each variant's median overhead beyond control.

    `runs` holds one `fastest` per process (one, unless `--processes`):
    `fastest[variant, i]`, instance i's seconds per step in each round. A
    replicate draws the rounds with replacement (the same draw for every
    variant: rounds are paired) and, for each variant separately, its
    instances with replacement, then computes the overhead as `summarize`
    does. With `--instances` above 1 the spread between model objects (which
    more rounds do not average out) is thus in the interval. With several
    runs, a replicate first draws the processes with replacement, then the
    rounds and instances within each drawn one, and pools the drawn rounds:
    what differs between whole processes is then in the interval too.

    Returns `{variant: array of samples}`, plus under `KEPT_BEYOND_FLOOR`
    those of kept's median overhead beyond the floor variant's, where both
    ran (as `summarize`'s `kept_beyond_floor`).
    """
    rng = np.random.default_rng(seed)
    times = [
        {v: np.stack([f[v, i] for i in range(_instances(f, v))]) for v in variants} for f in runs
    ]
    floor = "kept" in variants and "floor" in variants
    out = {v: np.empty(samples) for v in variants}
    if floor:
        out[KEPT_BEYOND_FLOOR] = np.empty(samples)
    for b in range(samples):
        chosen = rng.integers(0, len(runs), len(runs)) if len(runs) > 1 else [0]
        parts = []
        for k in chosen:
            rounds = times[k]["plain"].shape[1]
            picked = rng.integers(0, rounds, rounds)
            parts.append(
                {
                    v: t[rng.integers(0, len(t), len(t))][:, picked].mean(axis=0)
                    for v, t in times[k].items()
                }
            )
        mean = {v: np.concatenate([part[v] for part in parts]) for v in variants}
        control = mean["control"] / mean["plain"]
        for v in variants:
            out[v][b] = np.median(mean[v] / mean["plain"] - control)
        if floor:
            out[KEPT_BEYOND_FLOOR][b] = np.median((mean["kept"] - mean["floor"]) / mean["plain"])
    return out


def intervals(samples, target):
    """90% intervals from `bootstrap` samples, the target's verdict, and a
    lower bound (5th percentile) of recompute / kept.

    The interval of kept beyond the floor (None without both) is under
    `kept_beyond_floor_ci90`, not among the variants' in `ci90`.
    """
    ci = {v: [float(q) for q in np.percentile(s, [5, 95])] for v, s in samples.items()}
    beyond_floor = ci.pop(KEPT_BEYOND_FLOOR, None)
    out = {
        "ci90": ci,
        "target_verdict": None,
        "recompute_over_kept_low": None,
        "kept_beyond_floor_ci90": beyond_floor,
    }
    if "kept" in ci and target is not None:
        low, high = ci["kept"]
        out["target_verdict"] = (
            "met" if high <= target else "missed" if low > target else "undecided"
        )
    if "kept" in samples and "recompute" in samples:
        kept, recompute = samples["kept"], samples["recompute"]
        with np.errstate(divide="ignore", invalid="ignore"):
            factor = np.where(kept > 0, recompute / kept, np.inf)
        low = float(np.percentile(factor, 5))
        # JSON has no infinity: None where kept measured no slower than the
        # control in over 95% of the replicates.
        out["recompute_over_kept_low"] = low if np.isfinite(low) else None
    return out


def fastest_from(config):
    """`{(variant, instance): array[rounds, 2]}`: each round's fastest pass
    (wall, CPU seconds per step) of each instance, from a config's
    `pass_seconds_per_step`. The wall and CPU minima are taken separately
    (they can come from different passes), alike for every variant."""
    return {
        (v, i): np.asarray(passes).min(axis=1)
        for v, per_instance in config["pass_seconds_per_step"].items()
        for i, passes in enumerate(per_instance)
    }


def config_result(runs, variants, target):
    """Step times, overheads, intervals and verdicts of one config.

    `runs`: per process, `{(variant, instance): array[rounds, 2]}` of seconds
    per step (wall, CPU) in each round, the fastest pass of each. A round's
    time of an instance is its fastest pass, the one least slowed by other
    processes (interference only ever adds time). A variant's: the mean over
    its instances, which averages out what makes one model object
    persistently faster or slower than an identical one (where its buffers
    landed): within a process that effect does not average out over rounds.
    The rounds of several runs are pooled, in turn.
    """

    def per_round(column):
        return {
            v: np.concatenate(
                [
                    np.mean([f[v, i][:, column] for i in range(_instances(f, v))], axis=0)
                    for f in runs
                ]
            )
            for v in variants
        }

    wall, cpu = per_round(0), per_round(1)
    result = {
        "step_ms": {v: float(np.median(ts) * 1e3) for v, ts in wall.items()},
        "seconds_per_step": {v: [float(t) for t in ts] for v, ts in wall.items()},
        "cpu_seconds_per_step": {v: [float(t) for t in ts] for v, ts in cpu.items()},
    }
    result.update(summarize(wall))
    cpu_summary = summarize(cpu)
    result["cpu_ratio"] = cpu_summary["ratio"]
    result["cpu_beyond_control"] = cpu_summary["beyond_control"]
    if "kept_beyond_floor" in cpu_summary:
        result["cpu_kept_beyond_floor"] = cpu_summary["kept_beyond_floor"]
    result["target"] = target
    for key, column in (("wall", 0), ("cpu", 1)):
        samples = bootstrap([{k: t[:, column] for k, t in f.items()} for f in runs], variants)
        result[f"{key}_intervals"] = intervals(samples, target)
    result["meets_target"] = result["recompute_over_kept"] = None
    result["meets_recompute_factor"] = None
    if "kept" in wall:
        kept = result["beyond_control"]["kept"]["median"]
        if target is not None:
            result["meets_target"] = bool(kept <= target)
        if "recompute" in wall:
            recompute = result["beyond_control"]["recompute"]["median"]
            # None: keeping measured no slower than the control.
            result["recompute_over_kept"] = float(recompute / kept) if kept > 0 else None
            result["meets_recompute_factor"] = bool(
                kept <= 0 or recompute >= RECOMPUTE_FACTOR * kept
            )
    return result


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


def combine_processes(runs):
    """One config per model and jit from the results of several processes.

    Each config pools the rounds of all processes (`config_result`) and
    bootstraps over processes too (`bootstrap`); `per_process` keeps
    what each process measured alone. Unlike a config timed in one process,
    it has `steps_per_pass_by_process` (steps are sized in each process)
    and no `pass_seconds_per_step` (each process's is in `process_runs`).
    """
    configs = []
    variants = runs[0]["variants"]
    for c, first in enumerate(runs[0]["configs"]):
        per = [run["configs"][c] for run in runs]
        if len({(p["model"], p["jit_compile"]) for p in per}) != 1:
            raise ValueError(f"The processes timed different configs at {c}.")
        config = {
            key: first[key]
            for key in (
                "model",
                "jit_compile",
                "params",
                "param_mb",
                "batch_size",
                "instances",
                "passes_per_round",
            )
        }
        config["processes"] = len(per)
        config["rounds"] = sum(p["rounds"] for p in per)
        config["steps_per_pass_by_process"] = [p["steps_per_pass"] for p in per]
        config.update(config_result([fastest_from(p) for p in per], variants, first["target"]))
        config["per_process"] = [
            {
                "kept_beyond_control": p["beyond_control"].get("kept"),
                "kept_ci90": p["wall_intervals"]["ci90"].get("kept"),
                "kept_beyond_floor": p.get("kept_beyond_floor"),
                "plain_step_ms": p["step_ms"]["plain"],
            }
            for p in per
        ]
        configs.append(config)
    return configs


def combine_files(paths):
    """Pools the processes of earlier `--processes` runs, from their JSON.

    Every process must have timed the same variants with the same
    optimizer; the configs (model, jit, batch size) that every process
    timed are pooled (`combine_processes`), in the first process's order,
    and the others dropped: a run of both jit modes combines with a run of
    one into that one.

    Raises:
        ValueError: A file holds no process runs, or the runs differ in
            their variants or optimizer, or share no config.
    """
    runs = []
    for path in paths:
        with open(path) as f:
            found = json.load(f).get("process_runs")
        if not found:
            raise ValueError(
                f"{path} holds no process runs: `--combine` takes the JSON "
                "files of runs made with `--processes` 2 or more."
            )
        runs += found
    for key in ("variants", "optimizer"):
        if len({json.dumps(run[key]) for run in runs}) != 1:
            raise ValueError(f"The runs to combine differ in their {key}.")

    def key(config):
        return config["model"], config["jit_compile"], config["batch_size"]

    common = [
        key(c)
        for c in runs[0]["configs"]
        if all(key(c) in {key(d) for d in run["configs"]} for run in runs)
    ]
    if not common:
        raise ValueError("The runs to combine share no config (model, jit, batch size).")
    runs = [
        dict(run, configs=[next(c for c in run["configs"] if key(c) == k) for k in common])
        for run in runs
    ]
    return {
        "mode": "combined",
        "sources": list(paths),
        "variants": runs[0]["variants"],
        "optimizer": runs[0]["optimizer"],
        "configs": combine_processes(runs),
        "op_counts": [],
        "memory": [],
        "process_runs": runs,
        "complete": True,
    }
