"""Peak memory of `overhead.py`'s variants, each trained in a fresh process."""

import gc
import json
import os
import resource
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf
from overhead_variants import fit_briefly
from overhead_variants import model_specs
from overhead_variants import new_variant
from overhead_variants import run_steps

OVERHEAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overhead.py")


def _status_bytes(field):
    """`VmHWM` (peak RSS) or `VmRSS` of this process, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if field == "VmHWM":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return None


def _reset_peak_rss():
    """Restarts `VmHWM` from the current RSS (Linux 4.0+); False if it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_child(name, variant, smoke, steps, optimizer="adam"):
    """Runs in a subprocess: train one model, print its RSS figures as JSON.

    `peak_rss`: the process's peak RSS. `training_growth`: the peak during
    `fit` and the training steps over the RSS just before (the model built
    and compiled), which leaves out the import and build peaks.
    """
    build, batch_size, make_x = model_specs(smoke)[name]
    rng = np.random.default_rng(0)
    batch = (
        tf.constant(make_x(rng, batch_size)),
        tf.constant(rng.integers(0, 10, (batch_size,)).astype("int32")),
    )
    keras.utils.set_random_seed(0)
    model, callback = new_variant(variant, build, batch, jit_compile=False, optimizer=optimizer)
    gc.collect()
    peak_before = _status_bytes("VmHWM")
    rss_before = _status_bytes("VmRSS")
    reset = _reset_peak_rss()
    run_steps(*fit_briefly(model, callback, batch), steps)
    peak = _status_bytes("VmHWM")
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    print(
        json.dumps(
            {
                "peak_rss": max(peak, peak_before),
                "training_growth": peak - rss_before if reset and rss_before else None,
                "params": params,
            }
        )
    )


# glibc keeps freed memory below a threshold that grows with the sizes it
# sees (up to 32 MB): a tensor freed may stay resident, and the peak RSS then
# measures the allocator's history as much as the live buffers. With a fixed
# low threshold every large tensor is its own mapping, returned on free.
# "mmap-no-onednn" also turns off TensorFlow's oneDNN ops and their buffers.
ALLOCATORS = {
    "mmap": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    "default": {},
    "mmap-no-onednn": {"MALLOC_MMAP_THRESHOLD_": "65536", "TF_ENABLE_ONEDNN_OPTS": "0"},
}


def measure_memory(
    name, pairs, smoke, log, allocator="mmap", variants=("plain", "kept"), optimizer="adam"
):
    """RSS figures of fresh processes training each of `variants`."""
    variants = list(variants)
    env = dict(os.environ, **ALLOCATORS[allocator])
    records = {v: [] for v in variants}
    for i in range(pairs):
        # One process at a time: how a step's ops overlap, and so its peak,
        # changes when processes compete for the cores.
        shift = i % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            cmd = [
                sys.executable,
                OVERHEAD,
                "--memory-child",
                name,
                variant,
                "--steps",
                "20",
                "--optimizer",
                optimizer,
            ]
            if smoke:
                cmd.append("--smoke")
            child = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if child.returncode:
                raise RuntimeError(f"memory child {name}/{variant} failed:\n{child.stderr}")
            records[variant].append(json.loads(child.stdout.strip().splitlines()[-1]))
    mb = 2**20
    params = records["plain"][0]["params"]
    result = {
        "model": name,
        "allocator": allocator,
        "allocator_env": ALLOCATORS[allocator],
        "params": params,
        "param_mb": params * 4 / mb,
        "pairs": pairs,
        "peak_rss_mb": {v: [r["peak_rss"] / mb for r in rs] for v, rs in records.items()},
        "training_growth_mb": {
            v: [None if r["training_growth"] is None else r["training_growth"] / mb for r in rs]
            for v, rs in records.items()
        },
    }

    def extra(key, variant="kept"):
        values = result[key]
        if any(x is None for x in values[variant] + values["plain"]):
            return None
        return float(np.median(values[variant]) - np.median(values["plain"]))

    result["extra_mb"] = extra("peak_rss_mb")
    result["extra_training_growth_mb"] = extra("training_growth_mb")
    if "hand" in variants:
        result["hand_extra_mb"] = extra("peak_rss_mb", "hand")
        result["hand_extra_training_growth_mb"] = extra("training_growth_mb", "hand")
    log(
        f"  memory {name} ({allocator}): kept - plain peak RSS "
        f"{result['extra_mb']:+.1f} MB, growth in training "
        f"{result['extra_training_growth_mb']} MB; parameters "
        f"{result['param_mb']:.1f} MB"
    )
    return result
