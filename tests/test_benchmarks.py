"""`benchmarks/run.py`: every subcommand's `--smoke` run writes its numbers,
and the statistics give hand-checked values on made-up times.

Timings on a shared machine are noise at smoke size: only their presence is
asserted, never a ratio.
"""

import collections
import math

import keras
import numpy as np
import pytest
from conftest import load_benchmark
from conftest import run_benchmark
from test_distribute import _MARK  # noqa: F401  (the subprocess prints with it)

KEEPING = ["plain", "control", "kept", "every10", "hand", "floor", "recompute"]
QUARTILES = {"median", "q25", "q75"}


def _stats():
    return load_benchmark("stats")


def _run():
    return load_benchmark("run")


def _check_summary(config, variants):
    """Every variant has its ratios, overheads and intervals, in both clocks."""
    assert list(config["step_ms"]) == variants
    assert all(ms > 0 for ms in config["step_ms"].values())
    for clock in ("wall", "cpu"):
        found = config[clock]
        assert found["ratio"][config["base"]] == dict.fromkeys(QUARTILES, 1.0)
        for v in variants:
            beyond = found["beyond_control"][v]
            low, high = beyond["ci90"]
            assert low <= beyond["median"] <= high and math.isfinite(high)
            assert found["fastest_ratio"][v] > 0
        assert found["beyond_control"]["control"]["ci90"] == [0.0, 0.0]
    # The raw rounds are in the JSON: `[wall, cpu, ...]` seconds per step.
    (run,) = config["runs"]
    assert list(run) == variants
    assert all(len(rounds) == config["rounds"] for rounds in run.values())


@pytest.mark.slow
def test_keeping_smoke_writes_every_promised_number(tmp_path):
    proc, result = run_benchmark(tmp_path, "keeping", "--smoke", "--instances", "2", "--ops")
    assert "| kept |" in proc.stdout and "`kept - floor` per round" in proc.stdout
    assert result["mode"] == "smoke" and result["backend"] == "tensorflow"
    assert [(c["model"], c["jit_compile"]) for c in result["configs"]] == [
        ("mlp_1m", False),
        ("embedding", False),
    ]
    for config in result["configs"]:
        _check_summary(config, KEEPING)
        assert config["rounds"] == 2 and config["instances"] == 2
        # Kept beyond the floor, per round: (kept - floor) / plain.
        (run,) = config["runs"]
        t = {v: np.array(run[v])[:, 0] for v in ("plain", "kept", "floor")}
        pair = config["wall"]["pairs"]["kept - floor"]
        assert pair["median"] == pytest.approx(np.median((t["kept"] - t["floor"]) / t["plain"]))
        verdict = config["verdicts"]["kept"]
        assert verdict["target"] in (0.02, 0.03) and verdict["floor"] == "floor"
        assert verdict["budget"] in ("met", "missed", "undecided")
        assert verdict["against_floor"] in ("met", "missed")
    # Smoke sizes: 16*32+32 + 32*10+10.
    assert result["configs"][0]["params"] == 874

    ops = {o["model"]: o for o in result["op_counts"]}
    for o in ops.values():
        assert o["off_equals_plain"] is True and o["off"] == o["plain"]
        assert o["kept_missing_ops"] == {}
    # One write per variable: 4 in the MLP; the embedding's sparse gradient
    # is kept as values + indices, so 2 + 4 for its 5 variables.
    assert ops["mlp_1m"]["kept_extra_ops"]["AssignVariableOp"] == 4
    assert ops["embedding"]["kept_extra_ops"]["AssignVariableOp"] == 6


@pytest.mark.release
@pytest.mark.slow
def test_skipping_is_judged_against_keeping_plus_a_judgement_the_update_waits_for(tmp_path):
    # Both floors run; the skip is judged against `kept_guard`, spikes
    # against its spike floor (which floor is chosen when others ran:
    # test_skipping_and_spikes_are_judged_against_the_floors_that_ran).
    variants = ["kept", "kept_pass", "kept_wait", "kept_guard", "kept_guard_spike", "kept_lso"]
    variants += ["skip", "skip_spike"]
    args = ("keeping", "--smoke", "--models", "mlp_1m", "--variants", *variants)
    _, result = run_benchmark(tmp_path, *args)
    (config,) = result["configs"]
    assert list(config["step_ms"]) == ["plain", "control", *variants]
    floors = {"skip": "kept_guard", "skip_spike": "kept_guard_spike"}
    for variant, its_floor in floors.items():
        assert f"{variant} - {its_floor}" in config["wall"]["pairs"]
        verdict = config["verdicts"][variant]
        expected = (0.02, its_floor, 0.0)
        assert (verdict["target"], verdict["floor"], verdict["tolerance"]) == expected


@pytest.mark.parametrize(
    "floors, expected",
    [
        (
            ["kept_guard", "kept_guard_spike", "kept_wait", "kept_wait_spike"],
            {"skip": "kept_guard", "skip_spike": "kept_guard_spike"},
        ),
        (["kept_wait", "kept_wait_spike"], {"skip": "kept_wait", "skip_spike": "kept_wait_spike"}),
        # Without the spike floor of the skip's floor: the skip's floor.
        (["kept_guard", "kept_wait_spike"], {"skip": "kept_guard", "skip_spike": "kept_guard"}),
        (["kept_pass", "kept_wait_spike"], {"skip": "kept_pass", "skip_spike": "kept_pass"}),
        ([], {"skip": "kept", "skip_spike": "kept"}),
    ],
)
def test_skipping_and_spikes_are_judged_against_the_floors_that_ran(floors, expected):
    variants = ["kept", *floors, "skip", "skip_spike"]
    assert _run().skipping_floors(variants) == expected
    assert _run().skipping_floors(variants[:-1]) == {"skip": expected["skip"]}


def _two_adam_steps(floor, jit_compile):
    """`kept`'s and `floor`'s weights and optimizer variables after the
    same two Adam steps, and the `floor` model."""
    models = load_benchmark("models")
    spec = models.SMOKE_MODELS["mlp_1m"]
    weights = _run().initial_weights(spec)
    x, y = models.batch_of(spec, spec.batch_size * 2)
    found = {}
    for variant in ("kept", floor):
        model, _ = models.keeping_model(variant, spec, weights, jit_compile, "adam")
        model.fit(x, y, batch_size=spec.batch_size, shuffle=False, verbose=0)
        found[variant] = [
            np.asarray(v) for v in model.trainable_variables + model.optimizer.variables
        ]
    return found["kept"], found[floor], model


@pytest.mark.backends("tensorflow", reason="kept_guard is a TensorFlow graph floor")
def test_the_guarded_floor_updates_as_keeping_does_and_runs_without_xla_only():
    kept, guarded, _ = _two_adam_steps("kept_guard", False)
    # Its branches are always taken: bit for bit the same two Adam steps.
    assert all(np.array_equal(a, b) for a, b in zip(kept, guarded))
    assert len(kept) == len(guarded)
    models = load_benchmark("models")
    with pytest.raises(ValueError, match="without XLA only"):
        models.keeping_model("kept_guard", models.SMOKE_MODELS["mlp_1m"], None, True, "adam")


@pytest.mark.backends("tensorflow", reason="kept_wait is a TensorFlow graph floor")
def test_the_waiting_floor_under_xla_updates_as_keeping_does_and_judges_the_entries():
    import tensorflow as tf

    kept, waiting, model = _two_adam_steps("kept_wait", True)
    # Its judgement is always true here: bit for bit the same two Adam steps.
    assert len(kept) == len(waiting)
    assert all(np.array_equal(a, b) for a, b in zip(kept, waiting))
    # As the skip's under XLA, every entry: 3e38 squared overflows float32,
    # and is finite.
    judge = model.optimizer.judge
    assert bool(judge([tf.constant([3e38, 3e38]), tf.constant([[1.0]])])) is True
    assert bool(judge([tf.constant([1.0, np.inf]), tf.constant([[1.0]])])) is False
    assert bool(judge([tf.constant([1.0]), tf.constant([[np.nan]])])) is False


@pytest.mark.backends("tensorflow", reason="the spike floors are TensorFlow graph floors")
@pytest.mark.parametrize(
    "variant, jit_compile",
    [("kept_guard_spike", False), ("kept_wait_spike", False), ("kept_wait_spike", True)],
)
def test_the_spike_floors_update_as_keeping_does_and_keep_the_norms(variant, jit_compile):
    models = load_benchmark("models")
    spec = models.SMOKE_MODELS["mlp_1m"]
    weights = _run().initial_weights(spec)
    x, y = models.batch_of(spec, spec.batch_size * 2)

    def state(model):
        variables = model.trainable_variables + model.optimizer.variables
        return [np.asarray(v) for v in variables if v is not getattr(model.optimizer, "norms", 0)]

    kept, _ = models.keeping_model("kept", spec, weights, jit_compile, "adam")
    floor, _ = models.keeping_model(variant, spec, weights, jit_compile, "adam")
    norms = []
    for start in (0, spec.batch_size):
        batch = slice(start, start + spec.batch_size)
        for model in (kept, floor):
            model.fit(x[batch], y[batch], batch_size=spec.batch_size, verbose=0)
        grads = keras.tree.flatten(floor.gradients)
        norms.append(np.sqrt(sum(np.sum(np.square(np.asarray(g, "float64"))) for g in grads)))
    # No spike (the window was not full): bit for bit `kept`'s two steps.
    assert len(state(kept)) == len(state(floor))
    assert all(np.array_equal(a, b) for a, b in zip(state(kept), state(floor)))
    window = np.asarray(floor.optimizer.norms)
    assert np.array_equal(window[:-2], [-1.0] * (models.SPIKE_WINDOW - 2))
    # Float32 sums of the kept gradients, in another order: a few ulps apart.
    np.testing.assert_allclose(window[-2:], norms, rtol=1e-6)


@pytest.mark.backends("tensorflow", reason="the spike floors are TensorFlow graph floors")
def test_the_spike_floors_judge_by_the_spike_rule():
    import tensorflow as tf

    models = load_benchmark("models")
    spec = models.SMOKE_MODELS["mlp_1m"]
    floor, _ = models.keeping_model("kept_guard_spike", spec, None, False, "adam")
    optimizer = floor.optimizer
    optimizer.build(floor.trainable_variables)
    full = models.SPIKE_WINDOW
    # A global norm of 5: sqrt(3^2 + 4^2).
    grads = [tf.constant([3.0]), tf.constant([[4.0]])]

    def judge(window):
        optimizer.norms.assign(np.asarray(window, "float32"))
        return bool(optimizer.judge(grads)), np.asarray(optimizer.norms).tolist()

    # Median 0.4 (half 0.3s, half 0.5s): 5 > 10 * 0.4, a spike; it joins.
    window = [0.3] * (full // 2) + [0.5] * (full // 2)
    assert judge(window) == (False, [np.float32(v) for v in window[1:] + [5.0]])
    # Median 0.5: 5 is not above 10 * 0.5.
    assert judge([0.5] * full)[0] is True
    # Not full (one -1 left): never a spike.
    assert judge([-1.0] + [0.3] * (full - 1))[0] is True
    # A non-finite norm: bad, and the window left as it was.
    grads[0] = tf.constant([np.inf])
    assert judge([0.5] * full) == (False, [0.5] * full)
    # In a step: a spike's update leaves the weights and the optimizer's
    # variables (its iteration count too) as they were.
    x, y = models.batch_of(spec, spec.batch_size)
    variables = floor.trainable_variables + optimizer.variables
    variables = [v for v in variables if v is not optimizer.norms]
    before = [np.asarray(v) for v in variables]
    optimizer.norms.assign(np.full(full, 1e-6, "float32"))
    floor.fit(x, y, batch_size=spec.batch_size, verbose=0)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, variables))
    assert int(optimizer.iterations) == 0 and np.asarray(optimizer.norms)[-1] > 1e-5


def _mirrored_floors():
    """Under `MirroredStrategy` (2 logical CPUs): each variable's copies,
    after two steps of `kept` and of `kept_guard`, and after a third step
    of `kept_guard_spike` whose window was made a spike's."""
    import tensorflow as tf

    models = load_benchmark("models")
    spec = models.SMOKE_MODELS["mlp_1m"]
    weights = _run().initial_weights(spec)
    x, y = models.batch_of(spec, spec.batch_size * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    found = {}

    def copies(model):
        variables = model.trainable_variables + model.optimizer.variables
        values = [v.value for v in variables if v is not getattr(model.optimizer, "norms", 0)]
        return [[np.asarray(c).tolist() for c in v.values] for v in values]

    for variant in ("kept", "kept_guard", "kept_guard_spike"):
        with strategy.scope():
            model, _ = models.keeping_model(variant, spec, weights, False, "adam")
        found["initial"] = copies(model)[0]
        model.fit(x, y, batch_size=spec.batch_size, shuffle=False, verbose=0)
        found[variant] = copies(model)
    found["iterations"] = [int(c) for c in model.optimizer.iterations.value.values]
    norms = model.optimizer.norms.value.values
    found["window"] = [np.asarray(c)[-3:].tolist() for c in norms]
    for c in norms:
        c.assign(np.full(models.SPIKE_WINDOW, 1e-6, "float32"))
    model.fit(x[: spec.batch_size], y[: spec.batch_size], verbose=0)
    found["spiked"] = copies(model)
    found["spiked_window"] = [float(np.asarray(c)[-1]) for c in norms]
    found["spiked_iterations"] = [int(c) for c in model.optimizer.iterations.value.values]
    return found


@pytest.mark.release
@pytest.mark.slow
@pytest.mark.backends("tensorflow", reason="the guarded floors are TensorFlow graph floors")
def test_the_guarded_floors_under_mirrored_update_as_keeping_does_and_skip_a_spike():
    from test_distribute import _python
    from test_distribute import _result

    found = _result(_python("_mirrored_floors", devices=2, module="test_benchmarks"))
    # Their branches always taken: bit for bit the same two Adam steps.
    assert found["kept_guard"] == found["kept"] == found["kept_guard_spike"]
    assert found["kept"][0] != found["initial"] and found["iterations"] == [2, 2]
    # Each replica's window: -1, then the two steps' global norms (alike).
    windows = found["window"]
    assert windows[0] == windows[1] and windows[0][0] == -1.0 and min(windows[0][1:]) > 0
    # A spike: every copy of every variable as it was, the iteration count too.
    assert found["spiked"] == found["kept_guard_spike"] and found["spiked_iterations"] == [2, 2]
    assert all(w > 1e-5 for w in found["spiked_window"])


@pytest.mark.release
@pytest.mark.slow
def test_keeping_smoke_times_skipping_under_mirrored(tmp_path):
    variants = ["kept", "kept_wait", "kept_guard", "kept_guard_spike", "skip", "skip_spike"]
    args = ("keeping", "--smoke", "--mirrored", "--models", "mlp_1m", "--variants", *variants)
    _, result = run_benchmark(tmp_path, *args)
    (config,) = result["configs"]
    assert (config["replicas"], config["jit_compile"]) == (2, False)
    assert list(config["step_ms"]) == ["plain", "control", *variants]
    floors = {v: config["verdicts"][v]["floor"] for v in ("skip", "skip_spike")}
    assert floors == {"skip": "kept_guard", "skip_spike": "kept_guard_spike"}
    assert {"skip - kept_guard", "skip_spike - kept_guard_spike"} <= set(config["wall"]["pairs"])


@pytest.mark.release
@pytest.mark.slow
def test_processes_pool_their_rounds_and_pool_pools_runs(tmp_path):
    args = ["keeping", "--smoke", "--models", "mlp_1m", "--variants", "kept", "floor"]
    proc, result = run_benchmark(tmp_path, *args, "--processes", "2", out="two.json")
    assert "process 2 of 2" in proc.stderr
    (config,) = result["configs"]
    assert (config["processes"], config["rounds"], len(config["runs"])) == (2, 4, 2)
    medians = config["wall"]["beyond_control"]["kept"]["process_medians"]
    assert medians["values"] == [
        float(
            np.median(
                [(k[0] - c[0]) / p[0] for p, c, k in zip(r["plain"], r["control"], r["kept"])]
            )
        )
        for r in config["runs"]
    ]
    assert medians["interval"]["coverage"] == 0.5  # 2 processes: their range

    # `pool` pools runs made apart: here this one twice.
    pooled = _run().main(["pool", str(tmp_path / "two.json"), str(tmp_path / "two.json")])
    (again,) = pooled["configs"]
    assert (again["processes"], again["rounds"]) == (4, 8)
    assert again["runs"] == config["runs"] * 2


def test_pool_refuses_runs_that_do_not_match():
    run = _run()
    one = {"run": {v: [[1.0, 1.0]] for v in ("plain", "control", "kept")}}
    a = {
        "command": "keeping",
        "backend": "tensorflow",
        "configs": [dict(model="mlp_1m", base="plain", runs=[one["run"]])],
    }
    with pytest.raises(ValueError, match="must share their `command`"):
        run.pool([a, dict(a, command="metrics")])
    with pytest.raises(ValueError, match="share no config"):
        run.pool([a, dict(a, configs=[dict(a["configs"][0], model="conv")])])
    fewer = {v: t for v, t in one["run"].items() if v != "kept"}
    with pytest.raises(ValueError, match="time different variants of mlp_1m"):
        run.pool([a, dict(a, configs=[dict(a["configs"][0], runs=[fewer])])])


def test_child_processes_get_their_own_options():
    run = _run()
    argv = ["keeping", "--processes", "3", "--out=x.json", "--smoke", "--backend", "all", "--ops"]
    assert run.child_argv(argv, processes=1, out="p.json") == [
        "keeping",
        "--smoke",
        "--ops",
        "--processes",
        "1",
        "--out",
        "p.json",
    ]
    # Abbreviations would slip past that: the parsers refuse them.
    with pytest.raises(SystemExit):
        run.make_parser().parse_args(["keeping", "--proc", "3"])


def test_pass_order_puts_every_key_at_every_position_equally_often():
    stats = _stats()
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
    keys = list(range(8))
    assert stats.pass_order(keys, 3, 0, 2)[0] == 3
    assert stats.pass_order(keys, 3, 1, 2)[0] == 7


def test_median_interval_takes_the_order_statistics_of_its_coverage():
    stats = _stats()
    # n = 10: [x_(j), x_(11-j)] covers the median with probability
    # 1 - 2 P(X < j), X ~ binomial(10, 1/2): j = 2 gives 1 - 2 * 11/1024
    # (0.979), j = 3 gives 1 - 2 * 56/1024 (0.891 < 0.90).
    values = [7.0, 3.0, 10.0, 1.0, 5.0, 9.0, 2.0, 8.0, 4.0, 6.0]
    assert stats.median_interval(values) == {
        "low": 2.0,
        "high": 9.0,
        "coverage": 1.0 - 2.0 * 11 / 1024,
    }
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


def test_bootstrap_over_processes_draws_whole_processes():
    stats = _stats()
    # Process A ran 1 round at 0.25, B 3 rounds at 0.75. A replicate draws
    # 2 processes: AA pools 2 rounds at 0.25 (median 0.25, probability
    # 1/4); AB, BA, BB pool at least 3 rounds at 0.75 and at most 1 at
    # 0.25 (median 0.75). The 5th and 95th percentiles: 0.25 and 0.75.
    # Rounds drawn from one flat pool of 4 would also give 0.5.
    assert stats.bootstrap_median([[0.25], [0.75, 0.75, 0.75]]) == [0.25, 0.75]
    # One process: its rounds are drawn; equal rounds leave no spread.
    assert stats.bootstrap_median([[0.5, 0.5, 0.5]]) == [0.5, 0.5]
    low, high = stats.bootstrap_median([[0.0, 1.0, 2.0, 3.0, 4.0]])
    assert 0.0 <= low < 2.0 < high <= 4.0


def test_summary_divides_each_round_by_its_own_base_time():
    stats = _stats()
    # The machine slows down from round to round (1, 2, 4, 8) for every
    # variant alike: paired per round, it cancels out of every ratio.
    machine = np.array([1.0, 2.0, 4.0, 8.0])

    def run(kept):
        times = {"plain": machine, "control": machine, "kept": kept * machine}
        times["floor"] = 1.25 * machine
        return {v: np.stack([t, 2 * t, t], axis=1) for v, t in times.items()}

    found = stats.summarize(
        [run(1.25)],
        "plain",
        pairs=[("kept", "floor")],
        targets={"kept": 0.2},
        tolerance=0.0,
        measures=("wall", "cpu", "hooks_seconds"),
    )
    kept = found["wall"]["beyond_control"]["kept"]
    assert (kept["median"], kept["ci90"]) == (0.25, [0.25, 0.25])
    assert found["cpu"]["ratio"]["kept"]["median"] == 1.25
    pair = found["wall"]["pairs"]["kept - floor"]
    assert (pair["median"], pair["ratio"]["median"]) == (0.0, 1.0)
    assert found["step_ms"]["plain"] == 3e3  # median of 1, 2, 4, 8 s
    assert found["hooks_seconds_per_step"]["kept"] == 3.75
    # 0.25 beyond the control misses 0.2, but kept is at its floor.
    assert found["verdicts"]["kept"] == {
        "target": 0.2,
        "budget": "missed",
        "floor": "floor",
        "tolerance": 0.0,
        "against_floor": "met",
    }

    # Two processes: kept 0.25 beyond the control in one, 0.75 in the other.
    found = stats.summarize([run(1.25), run(1.75)], "plain", targets={"kept": 0.5})
    kept = found["wall"]["beyond_control"]["kept"]
    assert kept["process_medians"]["values"] == [0.25, 0.75]
    assert kept["ci90"] == [0.25, 0.75]
    assert found["verdicts"]["kept"] == {"target": 0.5, "budget": "undecided"}
    assert (found["processes"], found["rounds"]) == (2, 8)

    # `batch_wall` (wall time without a once-per-epoch cost) gets its own
    # ratios and verdict: kept costs 1.25x in wall, 1.0x per batch.
    times = {v: t.copy() for v, t in run(1.25).items()}
    times["kept"][:, 2] = machine
    found = stats.summarize(
        [times], "plain", targets={"kept": 0.1}, measures=("wall", "cpu", "batch_wall")
    )
    assert found["batch_wall"]["beyond_control"]["kept"]["median"] == 0.0
    assert found["verdicts"]["kept"] == {
        "target": 0.1,
        "budget": "missed",
        "budget_per_batch": "met",
    }


@pytest.mark.slow
def test_memory_smoke_measures_fresh_processes(tmp_path):
    _, result = run_benchmark(tmp_path, "memory", "--smoke")
    (memory,) = result["memory"]
    assert (memory["model"], memory["params"], memory["allocator"]) == ("mlp_1m", 874, "mmap")
    peaks = memory["peak_rss_mb"]
    assert list(peaks) == ["plain", "kept"] and all(
        len(v) == 1 and v[0] > 0 for v in peaks.values()
    )
    assert memory["extra_mb"] == {"plain": 0.0, "kept": peaks["kept"][0] - peaks["plain"][0]}


@pytest.mark.slow
def test_metrics_smoke_times_every_variant_against_the_reference(tmp_path):
    proc, result = run_benchmark(tmp_path, "metrics", "--smoke", "--threads", "1")
    (config,) = result["configs"]
    _check_summary(config, ["reference", "control", "grad_norm", "per_layer", "all"])
    assert config["params"] == 874 and config["rounds"] == 2 and result["threads"] == 1
    assert config["verdicts"]["grad_norm"]["target"] == 0.02
    assert "grad_norm: at most +2.0% beyond control" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend, mirrored, floors",
    [
        ("tensorflow", False, ["floor_window", "floor_window", "floor_dot", "floor_dot"]),
        pytest.param(
            "tensorflow",
            True,
            ["floor_replicas", "floor_replicas", "floor_dot", "floor_dot"],
            marks=pytest.mark.release,
        ),
        # Whole `fit` calls of 4 steps (one window), the floors' buffers
        # threaded through JAX's stateless step.
        ("jax", False, ["floor_window", "floor_window", "floor_dot", "floor_dot"]),
    ],
)
def test_dynamics_smoke_times_each_statistic_beside_its_floor(tmp_path, backend, mirrored, floors):
    args = ["dynamics", "--smoke", "--backend", backend] + (["--mirrored"] if mirrored else [])
    proc, result = run_benchmark(tmp_path, *args)
    assert result["backend"] == backend
    (config,) = result["configs"]
    variants = ["reference", "control", "grad_norm", "noise_scale", "snr", "cosine"]
    variants += ["cosine_per_layer", "floor_window", "floor_dot"]
    _check_summary(config, variants + (["floor_replicas"] if mirrored else []))
    assert config["replicas"] == (2 if mirrored else 1)
    assert config["jit_compile"] == ("auto" if backend == "jax" else False)
    if backend == "jax":
        assert config["steps"] == 4
    statistics = ("noise_scale", "snr", "cosine", "cosine_per_layer")
    for statistic, floor in zip(statistics, floors):
        assert f"{statistic} - {floor}" in config["wall"]["pairs"]
        verdict = config["verdicts"][statistic]
        assert (verdict["target"], verdict["floor"], verdict["tolerance"]) == (0.03, floor, 0.03)
    assert "noise_scale: at most +3.0% beyond control" in proc.stdout


TENSORBOARD_SETUPS = {
    "watched": ["plain", "control", "watched"],
    "batch": ["plain", "control", "kept", "all"],
    "epoch": ["none", "control", "keras_tb", "grad_tb", "keras_tb_1", "grad_tb_1", "monitor"],
}


def _check_tensorboard_config(config, setup):
    variants = TENSORBOARD_SETUPS[setup]
    _check_summary(config, variants)
    assert config["setup"] == setup and config["steps"] in (3, 6)
    hooks, written = config["hooks_seconds_per_step"], config["event_bytes_per_step"]
    for v in variants:
        # A variant with a TensorBoard writes and spends time in it;
        # in `epoch` the base and the control have no callback.
        writes = "tb" in v or v in ("plain", "kept", "watched", "all")
        writes = writes or (v == "control" and setup != "epoch")
        assert (written[v] > 0) == writes and (hooks[v] > 0) == (writes or v == "monitor")
    if setup == "watched":
        # Per step of a long run: the gradient scalars, beyond Keras's loss.
        steady = config["steady_event_bytes_per_step"]
        assert steady["watched"] > steady["plain"] > 0
        assert set(config["verdicts"]["watched"]) == {"target", "budget", "budget_per_batch"}


# `watched`, the default setup, on the tiny model alone (its `mlp_1m_wide`
# run is the release's, as are the other setups and every backend's run).
@pytest.mark.slow
@pytest.mark.parametrize(
    "setup",
    [
        "watched",
        pytest.param("batch", marks=pytest.mark.release),
        pytest.param("epoch", marks=pytest.mark.release),
    ],
)
def test_tensorboard_smoke_times_each_fit_and_its_writes(tmp_path, setup):
    models = ("--models", "tiny") if setup == "watched" else ()
    _, result = run_benchmark(tmp_path, "tensorboard", "--smoke", "--setup", setup, *models)
    for config in result["configs"]:
        _check_tensorboard_config(config, setup)
    assert [c["model"] for c in result["configs"]] == {
        "watched": ["tiny"],
        "batch": ["mlp_6k", "mlp_1m"],
        "epoch": ["mlp_1m"],
    }[setup]


@pytest.mark.release
@pytest.mark.slow
def test_every_backend_runs_in_its_own_process(tmp_path):
    args = ("tensorboard", "--smoke", "--models", "tiny", "--backend", "all")
    _, result = run_benchmark(tmp_path, *args)
    assert list(result["backends"]) == ["tensorflow", "jax", "torch"]
    for backend, found in result["backends"].items():
        assert found["backend"] == backend and backend in found["versions"]
        assert [c["model"] for c in found["configs"]] == ["tiny"]
        for config in found["configs"]:
            _check_tensorboard_config(config, "watched")
