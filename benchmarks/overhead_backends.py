"""What keeping gradients costs on Keras's JAX and PyTorch backends.

Paired, interleaved rounds, as `overhead.py` does on TensorFlow: each round
trains every variant (a plain `keras.Model`, a second one as the noise
control, `KeepGradModel`) for the same batches, in an order rotated each
round, with Keras's default step (jitted on JAX, eager on PyTorch), and
divides each variant's time by the plain model's time of the same round.
The models are those of `overhead.py`: the 1M-parameter MLP and the
CIFAR-sized conv net. On JAX it also reads XLA's cost analysis of the two
compiled steps.

    KERAS_BACKEND=jax python benchmarks/overhead_backends.py           # a few minutes
    KERAS_BACKEND=torch python benchmarks/overhead_backends.py
    KERAS_BACKEND=jax python benchmarks/overhead_backends.py --smoke   # tiny, seconds

Prints a Markdown table and writes JSON to
`benchmarks/results/overhead-<backend>-<mode>.json` (or `--out`).
"""

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from overhead_models import conv as _conv  # noqa: E402
from overhead_models import mlp as _mlp  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

VARIANTS = ("plain", "control", "kept")
# On PyTorch also the floor of keeping: a plain model that copies every
# gradient after its step, one parameter-sized write (on JAX, XLA's cost
# analysis below counts the bytes instead).
TORCH_VARIANTS = (*VARIANTS, "floor")


def variants():
    return TORCH_VARIANTS if keras.backend.backend() == "torch" else VARIANTS


def _floor_model(inputs, outputs):
    import torch

    class CopyingModel(keras.Model):
        def train_step(self, data):
            logs = super().train_step(data)
            with torch.no_grad():
                self.copies = [v.value.grad.clone() for v in self.trainable_weights]
            return logs

    return CopyingModel(inputs, outputs)


BACKENDS = ("jax", "torch")


def model_specs(smoke):
    """`{name: (build, batch_size, input shape)}`, as in `overhead_variants`."""
    if smoke:
        return {"mlp_1m": (_mlp(16, [32], 10), 8, (16,)), "conv": (_conv(8, [4], 8), 8, (8, 8, 3))}
    return {
        # 512*1024 + 1024*512 + 512*10 (+ biases) = 1.06M parameters.
        "mlp_1m": (_mlp(512, [1024, 512], 10), 128, (512,)),
        # CIFAR-sized: conv 32, conv 64, dense 128: 0.32M parameters.
        "conv": (_conv(32, [32, 64], 128), 64, (32, 32, 3)),
    }


def make(variant, build):
    keras.utils.set_random_seed(0)
    inputs, outputs = build()
    if variant == "floor":
        model = _floor_model(inputs, outputs)
    else:
        model = (kg.KeepGradModel if variant == "kept" else keras.Model)(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def train(model, x, y, batch_size):
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    if keras.backend.backend() == "jax":
        import jax

        # Dispatch is asynchronous on JAX; PyTorch's CPU ops are not.
        jax.block_until_ready([v.value for v in model.trainable_variables])
    return time.perf_counter() - start


def xla_cost(models, x, y, batch_size):
    """`{variant: (bytes accessed, flops)}` of one compiled step, by XLA."""
    import jax

    batch = (jax.numpy.asarray(x[:batch_size]), jax.numpy.asarray(y[:batch_size]))
    costs = {}
    for variant in ("plain", "kept"):
        model = models[variant]
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        if variant == "plain":
            # As Keras 3.15's `JAXTrainer.make_train_function` jits it.
            lowered = jax.jit(model.train_step, donate_argnums=0).lower(state, batch)
        else:
            keeper = model._keeper
            lowered = keeper.compiled_step(True).lower(state, keeper.slots, batch)
        cost = lowered.compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        costs[variant] = (float(cost["bytes accessed"]), float(cost["flops"]))
    return costs


def measure(name, build, batch_size, shape, rounds, steps):
    rng = np.random.default_rng(0)
    x = rng.random((batch_size * steps, *shape), "float32")
    y = rng.integers(0, 10, (batch_size * steps,))
    names = variants()
    models = {v: make(v, build) for v in names}
    for model in models.values():  # compile and warm up
        train(model, x[: 2 * batch_size], y[: 2 * batch_size], batch_size)
    params = sum(int(np.prod(v.shape)) for v in models["plain"].trainable_variables)
    jax_backend = keras.backend.backend() == "jax"
    costs = xla_cost(models, x, y, batch_size) if jax_backend else None
    ratios = {v: [] for v in names if v != "plain"}
    seconds = {v: [] for v in names}
    plain_ms = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        times = {v: train(models[v], x, y, batch_size) for v in order}
        for v in names:
            seconds[v].append(times[v])
        plain_ms.append(1000 * times["plain"] / steps)
        for v in ratios:
            ratios[v].append(times[v] / times["plain"])
    kept = models["kept"].get_gradients_by_path()
    assert len(kept) == len(models["kept"].trainable_variables)
    result = {
        "model": name,
        "parameters": params,
        "batch_size": batch_size,
        "steps_per_round": steps,
        "rounds": rounds,
        "plain_ms_per_step_median": statistics.median(plain_ms),
        "ratios": ratios,
        "median": {v: statistics.median(rs) for v, rs in ratios.items()},
        # Robust to load from other processes: each variant's fastest round.
        "fastest_ratio": {v: min(seconds[v]) / min(seconds["plain"]) for v in ratios},
    }
    if "floor" in ratios:
        # Paired per round: what keeping adds beyond its one write.
        beyond = [k - f for k, f in zip(ratios["kept"], ratios["floor"])]
        result["kept_beyond_floor_median"] = statistics.median(beyond)
    if costs is not None:
        result.update(
            xla_bytes_accessed={v: c[0] for v, c in costs.items()},
            xla_flops={v: c[1] for v, c in costs.items()},
            # Extra bytes the kept step moves, in parameter-sized float32 writes.
            extra_bytes_in_parameter_writes=(costs["kept"][0] - costs["plain"][0]) / (4 * params),
        )
    return result


def markdown(results):
    xla = "extra_bytes_in_parameter_writes" in results[0]
    floor = "kept_beyond_floor_median" in results[0]
    lines = [
        "| model | parameters | plain ms/step | control / plain | kept / plain "
        "| fastest rounds, control / plain | fastest rounds, kept / plain |"
        + (" floor / plain | kept beyond floor |" if floor else "")
        + (" extra XLA bytes accessed, in parameter writes |" if xla else ""),
        "|---|---:|---:|---:|---:|---:|---:|"
        + ("---:|---:|" if floor else "")
        + ("---:|" if xla else ""),
    ]
    for res in results:
        spread = {v: (min(rs), max(rs)) for v, rs in res["ratios"].items()}
        lines.append(
            f"| {res['model']} | {res['parameters']:,} | {res['plain_ms_per_step_median']:.2f} | "
            f"{res['median']['control']:.3f} ({spread['control'][0]:.3f}-"
            f"{spread['control'][1]:.3f}) | {res['median']['kept']:.3f} "
            f"({spread['kept'][0]:.3f}-{spread['kept'][1]:.3f}) | "
            f"{res['fastest_ratio']['control']:.3f} | {res['fastest_ratio']['kept']:.3f} |"
            + (
                f" {res['median']['floor']:.3f} ({spread['floor'][0]:.3f}-"
                f"{spread['floor'][1]:.3f}) | {res['kept_beyond_floor_median']:+.3f} |"
                if floor
                else ""
            )
            + (f" {res['extra_bytes_in_parameter_writes']:.2f} |" if xla else "")
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models, 2 rounds")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    backend = keras.backend.backend()
    if backend not in BACKENDS:
        parser.error(
            f"run with KERAS_BACKEND=jax or KERAS_BACKEND=torch (Keras runs on {backend!r}; "
            "benchmarks/overhead.py measures TensorFlow)"
        )
    rounds, steps = (2, 3) if args.smoke else (args.rounds, args.steps)
    results = [
        measure(name, build, batch, shape, rounds, steps)
        for name, (build, batch, shape) in model_specs(args.smoke).items()
    ]
    table = markdown(results)
    print(table)
    out = args.out or os.path.join(
        HERE, "results", f"overhead-{backend}-{'smoke' if args.smoke else 'full'}.json"
    )
    library = importlib.import_module(backend)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                "versions": {backend: library.__version__, "keras": keras.__version__},
                "results": results,
                "table": table,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
