"""`benchmarks/overhead.py --smoke` runs end to end and writes its JSON.

Timings on a shared machine are noise at this size: only their presence and
sign are asserted, never a ratio. The bootstrap interval is checked on
made-up times.
"""

import collections
import json

import numpy as np
import pytest
from conftest import load_benchmark
from conftest import run_benchmark

VARIANTS = ["plain", "control", "kept", "every10", "hand", "floor", "recompute"]
STATS = {"median", "q25", "q75"}


@pytest.mark.slow
def test_overhead_smoke_writes_every_promised_number(tmp_path):
    proc, results = run_benchmark(
        tmp_path, "overhead.py", "--smoke", "--instances", "2", out="smoke.json"
    )
    assert "| model | params | batch | jit |" in proc.stdout

    assert results["mode"] == "smoke" and results["complete"] is True
    assert results["variants"] == VARIANTS
    assert results["machine_before"]["cpu_count"] >= 1
    assert len(results["machine_after"]["loadavg"]) == 3

    configs = {(c["model"], c["jit_compile"]): c for c in results["configs"]}
    assert set(configs) == {("mlp_1m", False), ("embedding", False)}
    # Smoke sizes: Dense(16->32) + Dense(32->10) = 16*32+32 + 32*10+10 = 874;
    # Embedding(100, 4) + Dense(4->64) + Dense(64->10) = 400 + 320 + 650.
    assert configs["mlp_1m", False]["params"] == 874
    assert configs["embedding", False]["params"] == 1370
    for config in configs.values():
        assert config["rounds"] == 2 and config["passes_per_round"] == 2
        assert config["steps_per_pass"] >= 1
        assert config["instances"] == 2
        for variant, per_instance in config["pass_seconds_per_step"].items():
            # [instance][round][pass] = [wall, cpu]
            assert len(per_instance) == 2
            for passes in per_instance:
                assert len(passes) == 2 and all(len(p) == 2 for p in passes)
            # An instance's round time is its fastest pass; a variant's, the
            # mean over its instances.
            first, second = (
                [min(wall for wall, _ in rnd) for rnd in passes] for passes in per_instance
            )
            assert config["seconds_per_step"][variant] == [
                (a + b) / 2 for a, b in zip(first, second)
            ]
        for key in ("seconds_per_step", "cpu_seconds_per_step"):
            assert set(config[key]) == set(VARIANTS)
            for seconds in config[key].values():
                assert len(seconds) == 2 and all(t > 0 for t in seconds)
        assert all(config["step_ms"][v] > 0 for v in VARIANTS)
        for key in ("ratio", "beyond_control", "cpu_ratio", "cpu_beyond_control"):
            assert set(config[key]) == set(VARIANTS)
            assert all(set(s) == STATS for s in config[key].values())
        # The control against itself: ratio - ratio is exactly 0 per round.
        assert config["beyond_control"]["control"] == dict.fromkeys(STATS, 0.0)
        assert config["target"] in (0.02, 0.03)
        assert isinstance(config["meets_target"], bool)
        for key in ("wall_intervals", "cpu_intervals"):
            found = config[key]
            assert set(found["ci90"]) == set(VARIANTS)
            assert all(low <= high for low, high in found["ci90"].values())
            assert found["target_verdict"] in ("met", "missed", "undecided")
            low, high = found["kept_beyond_floor_ci90"]
            assert low <= high
        # Kept beyond the floor, per round: (kept - floor) / plain.
        for key, times in (
            ("kept_beyond_floor", "seconds_per_step"),
            ("cpu_kept_beyond_floor", "cpu_seconds_per_step"),
        ):
            t = {v: np.array(config[times][v]) for v in ("plain", "kept", "floor")}
            per_round = (t["kept"] - t["floor"]) / t["plain"]
            assert config[key]["median"] == np.percentile(per_round, 50)

    ops = {o["model"]: o for o in results["op_counts"]}
    assert set(ops) == {"mlp_1m", "embedding"}
    for o in ops.values():
        assert o["off_equals_plain"] is True and o["off"] == o["plain"]
        assert o["kept_missing_ops"] == {}
    # One write per variable: 4 in the MLP; the embedding's sparse gradient
    # is kept as values + indices, so 2 + 4 for its 5 variables.
    assert ops["mlp_1m"]["kept_extra_ops"]["AssignVariableOp"] == 4
    assert ops["embedding"]["kept_extra_ops"]["AssignVariableOp"] == 6

    (memory,) = results["memory"]
    assert memory["model"] == "mlp_1m" and memory["params"] == 874
    for variant in ("plain", "kept"):
        assert len(memory["peak_rss_mb"][variant]) == 1
        assert memory["peak_rss_mb"][variant][0] > 0
    assert isinstance(memory["extra_mb"], float)


def _overhead_module():
    return load_benchmark("overhead")


def _stats_module():
    return load_benchmark("overhead_stats")


def test_pass_order_puts_every_key_at_every_position_equally_often():
    stats = _stats_module()
    for n_variants, instances in ((4, 2), (5, 2), (2, 1), (7, 1)):
        keys = [(v, i) for i in range(instances) for v in range(n_variants)]
        n = len(keys)
        for p in range(2):
            seen = collections.Counter()
            for r in range(n):
                order = stats.pass_order(keys, r, p, 2)
                assert sorted(order) == sorted(keys)
                seen.update(enumerate(order))
            # Over n rounds each (position, key) pair once: each key first
            # once in pass 0, right after the round's garbage collection.
            assert len(seen) == n * n and set(seen.values()) == {1}
    # The passes of one round start at different keys.
    keys = list(range(8))
    assert stats.pass_order(keys, 3, 0, 2)[0] == 3
    assert stats.pass_order(keys, 3, 1, 2)[0] == 7


def test_bootstrap_interval_spans_the_spread_between_model_objects():
    stats = _stats_module()
    # Seconds per step in each round, per (variant, instance). The machine
    # slows down from round to round (1, 2, 4, 8) for every variant alike:
    # drawn paired, rounds cancel out of each ratio; drawn apart, they would
    # not. So only the draw of instances varies: kept's mean over its two is
    # 1.25, 1.5 or 1.75 times plain's (probabilities 1/4, 1/2, 1/4), and its
    # overhead over plain (control equal to plain) is 0.25, 0.5 or 0.75.
    machine = np.array([1.0, 2.0, 4.0, 8.0])
    fastest = {
        ("plain", 0): machine,
        ("plain", 1): machine,
        ("control", 0): machine,
        ("control", 1): machine,
        ("kept", 0): 1.25 * machine,
        ("kept", 1): 1.75 * machine,
        ("recompute", 0): 2.0 * machine,
        ("recompute", 1): 2.0 * machine,
    }
    variants = ["plain", "control", "kept", "recompute"]
    samples = stats.bootstrap([fastest], variants, samples=400)
    assert set(np.unique(samples["kept"])) == {0.25, 0.5, 0.75}
    assert set(np.unique(samples["recompute"])) == {1.0}

    found = stats.intervals(samples, target=0.5)
    assert found["ci90"]["kept"] == [0.25, 0.75]
    assert found["target_verdict"] == "undecided"
    # recompute / kept: 4, 2 or 4/3; the 5th percentile is the worst, 4/3.
    assert found["recompute_over_kept_low"] == 1.0 / 0.75
    assert stats.intervals(samples, target=0.75)["target_verdict"] == "met"
    assert stats.intervals(samples, target=0.125)["target_verdict"] == "missed"

    # With a floor variant, kept's overhead beyond it: kept's mean is 1.25,
    # 1.5 or 1.75 times plain's and the floor's always 1.25, so 0, 0.25 or 0.5.
    fastest["floor", 0] = fastest["floor", 1] = 1.25 * machine
    samples = stats.bootstrap([fastest], variants + ["floor"], samples=400)
    assert set(np.unique(samples[stats.KEPT_BEYOND_FLOOR])) == {0.0, 0.25, 0.5}
    found = stats.intervals(samples, target=0.5)
    assert found["kept_beyond_floor_ci90"] == [0.0, 0.5]
    assert set(found["ci90"]) == {"plain", "control", "kept", "recompute", "floor"}
    assert (
        stats.intervals(stats.bootstrap([fastest], variants, samples=10), target=0.5)[
            "kept_beyond_floor_ci90"
        ]
        is None
    )

    # One instance: only the rounds are drawn; identical rounds leave no spread.
    one = {k: v for k, v in fastest.items() if k[1] == 0}
    samples = stats.bootstrap([one], variants, samples=50)
    assert stats.intervals(samples, target=0.25)["ci90"]["kept"] == [0.25, 0.25]


def test_median_interval_takes_the_order_statistics_of_its_coverage():
    stats = _stats_module()
    # n = 10: [x_(j), x_(11-j)] covers the median with probability
    # 1 - 2 P(X < j), X ~ binomial(10, 1/2): j = 2 gives 1 - 2 * 11/1024
    # (0.979), j = 3 gives 1 - 2 * 56/1024 (0.891 < 0.90).
    values = [7.0, 3.0, 10.0, 1.0, 5.0, 9.0, 2.0, 8.0, 4.0, 6.0]
    assert stats.median_interval(values) == {
        "low": 2.0,
        "high": 9.0,
        "coverage": 1.0 - 2.0 * 11 / 1024,
    }
    # At 0.89 the third order statistics do.
    assert stats.median_interval(values, level=0.89) == {
        "low": 3.0,
        "high": 8.0,
        "coverage": 1.0 - 2.0 * 56 / 1024,
    }
    # Too few values for 90%: all of them, at the coverage they have.
    assert stats.median_interval([2.0, 1.0, 3.0, 4.0]) == {
        "low": 1.0,
        "high": 4.0,
        "coverage": 1.0 - 2.0 / 16,
    }
    with pytest.raises(ValueError, match="`values` must not be empty"):
        stats.median_interval([])


def test_bootstrap_over_processes_draws_whole_processes_before_rounds():
    stats = _stats_module()

    # Process A ran 1 round, B 3; one instance each, control equal to plain.
    # Kept's overhead is 0.25 in A's round and 0.75 in each of B's. A
    # replicate draws 2 processes: AA pools 2 rounds at 0.25 (median 0.25);
    # AB, BA and BB pool at least 3 rounds at 0.75 and at most 1 at 0.25
    # (median 0.75). Rounds drawn from one flat pool of 4 would also give
    # 2 + 2, median 0.5: that value must never appear.
    def run(machine, kept):
        machine = np.asarray(machine)
        return {("plain", 0): machine, ("control", 0): machine, ("kept", 0): kept * machine}

    runs = [run([1.0], 1.25), run([1.0, 2.0, 4.0], 1.75)]
    samples = stats.bootstrap(runs, ["plain", "control", "kept"], samples=400)
    assert set(np.unique(samples["kept"])) == {0.25, 0.75}
    # AA has probability 1/4.
    assert 0.15 < np.mean(samples["kept"] == 0.25) < 0.35
    assert set(np.unique(samples["control"])) == {0.0}

    # The combined config pools the rounds of both, in turn: per round
    # 0.25, 0.75, 0.75, 0.75, so the median is 0.75.
    found = stats.config_result(
        [{k: np.stack([t, t], axis=1) for k, t in r.items()} for r in runs],
        ["plain", "control", "kept"],
        target=0.5,
    )
    assert found["seconds_per_step"]["kept"] == [1.25, 1.75, 3.5, 7.0]
    assert found["beyond_control"]["kept"]["median"] == 0.75
    assert found["wall_intervals"]["ci90"]["kept"] == [0.25, 0.75]
    assert found["wall_intervals"]["target_verdict"] == "undecided"
    assert found["meets_target"] is False


@pytest.mark.slow
def test_overhead_in_processes_pools_their_rounds(tmp_path):
    out = tmp_path / "processes.json"
    proc, results = run_benchmark(
        tmp_path,
        "overhead.py",
        "--smoke",
        "--processes",
        "2",
        "--models",
        "mlp_1m",
        "--variants",
        "kept",
        "floor",
        "--no-memory",
        "--no-ops",
        out="processes.json",
    )
    assert "process 2 of 2:" in proc.stderr
    assert "Each process alone (`--processes`)" in proc.stdout
    assert results["complete"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["processes.json"]

    runs = results["process_runs"]
    assert len(runs) == 2
    (config,) = results["configs"]
    assert (config["model"], config["jit_compile"], config["processes"]) == ("mlp_1m", False, 2)
    # 2 smoke rounds per process, pooled in process order.
    assert config["rounds"] == 4
    for variant in ("plain", "control", "kept", "floor"):
        assert config["seconds_per_step"][variant] == (
            runs[0]["configs"][0]["seconds_per_step"][variant]
            + runs[1]["configs"][0]["seconds_per_step"][variant]
        )
    assert config["steps_per_pass_by_process"] == [
        run["configs"][0]["steps_per_pass"] for run in runs
    ]
    assert [p["kept_beyond_control"] for p in config["per_process"]] == [
        run["configs"][0]["beyond_control"]["kept"] for run in runs
    ]
    # The processes only timed: memory and op counts are the parent's
    # (here turned off too).
    assert all(run["memory"] == [] and run["op_counts"] == [] for run in runs)
    assert all(run["mode"] == "smoke" for run in runs)

    # `--combine` pools runs made apart: here this one and a copy whose
    # processes also timed a config this one lacks, which is dropped.
    other = json.loads(out.read_text())
    for run in other["process_runs"]:
        run["configs"].append(dict(run["configs"][0], jit_compile=True))
    (tmp_path / "other.json").write_text(json.dumps(other))
    combined_path = tmp_path / "combined.json"
    overhead = _overhead_module()
    overhead.main(
        ["--combine", str(out), str(tmp_path / "other.json"), "--out", str(combined_path)]
    )
    combined = json.loads(combined_path.read_text())
    assert combined["sources"] == [str(out), str(tmp_path / "other.json")]
    (pooled,) = combined["configs"]
    assert (pooled["jit_compile"], pooled["processes"], pooled["rounds"]) == (False, 4, 8)
    for variant in ("plain", "control", "kept", "floor"):
        assert pooled["seconds_per_step"][variant] == 2 * config["seconds_per_step"][variant]
    assert pooled["per_process"] == 2 * config["per_process"]

    other["process_runs"][0]["variants"] = ["plain", "control", "kept"]
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="differ in their variants"):
        overhead.combine_files([str(out), str(tmp_path / "other.json")])
    (tmp_path / "single.json").write_text(json.dumps({"configs": []}))
    with pytest.raises(ValueError, match="single.json holds no process runs"):
        overhead.combine_files([str(out), str(tmp_path / "single.json")])


def test_a_process_of_processes_times_only_itself_whatever_the_spelling():
    overhead = _overhead_module()
    parser = overhead.make_parser()
    for argv in (
        ["--processes", "3"],
        ["--processes=3"],
        ["--proc", "3"],
        ["--process=3", "--ou", "x.json"],
    ):
        args = parser.parse_args(
            overhead.child_args(argv + ["--smoke", "--out", "y.json"], "p.json")
        )
        assert args.processes == 1, argv
        assert args.out == "p.json", argv
        assert args.smoke and args.no_memory and args.no_ops, argv


def test_per_batch_overhead_smoke_reports_paired_ratios(tmp_path):
    proc, results = run_benchmark(
        tmp_path, "per_batch_overhead.py", "--smoke", out="per_batch.json"
    )
    assert "| model | params | batch | keras ms/step | kept / keras | all / keras " in proc.stdout
    assert results["smoke"] is True
    by_model = {r["model"]: r for r in results["results"]}
    # Smoke sizes: Dense(8->4) + Dense(4->1) = 36 + 5; Dense(16->32) +
    # Dense(32->10) = 544 + 330.
    assert by_model["tiny"]["params"] == 41 and by_model["mlp_1m"]["params"] == 874
    for r in by_model.values():
        assert r["rounds"] == 2 and r["steps"] == 6
        for measure in ("seconds", "cpu_seconds"):
            assert set(r[measure]) == {"keras", "kept", "all"}
            assert all(len(t) == 2 and min(t) > 0 for t in r[measure].values())
        for key in ("ratios", "cpu_ratios"):
            # Every ratio is against the same round's `keras` time.
            assert r[key]["keras"] == {"median": 1.0, "q25": 1.0, "q75": 1.0}
            assert r[key]["all"]["median"] > 0


def test_metric_overhead_smoke_times_every_variant_against_the_reference(tmp_path):
    proc, result = run_benchmark(tmp_path, "metric_overhead.py", "--smoke", out="metric.json")
    assert "GradientNorm: " in proc.stdout and "the 2% budget." in proc.stdout
    # Smoke sizes: 16*32+32 + 32*16+16 + 16*10+10 = 1242 parameters.
    assert result["params"] == 1242 and result["rounds"] == 2 and result["mode"] == "smoke"
    assert list(result["variants"]) == ["reference", "control", "grad_norm", "per_layer", "all"]
    reference = result["variants"]["reference"]
    assert reference["ratio"] == {"median": 1.0, "q25": 1.0, "q75": 1.0}
    assert all(v["step_ms"] > 0 for v in result["variants"].values())
