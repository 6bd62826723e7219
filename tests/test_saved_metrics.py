"""Metrics saved before `keras_keepgrad.metrics` became a package still load.

Saved configs name a metric by its registered name
(`keras_keepgrad>GradientNorm`), which did not change, and by the module
that defined it then: `keras_keepgrad.metrics`, or `keras_keepgrad._dynamics`
for the training-dynamics metrics, which no longer exists.
`data/metrics_before_package.keras` was saved by that version (commit
0cf963c): the one-weight model of conftest.py after two SGD(0.1) steps
(w = 3 -> 1.5 -> 0.75), compiled with every metric below.
"""

import importlib
import inspect
import json
import os
import zipfile

import keras
import numpy as np
from conftest import X
from conftest import Y

import keras_keepgrad as kg

# `keras.saving.serialize_keras_object(metric)` of each, as that version wrote it.
SAVED = json.loads("""[
{"module": "keras_keepgrad.metrics", "class_name": "GradientNorm",
 "config": {"name": "grad_norm", "reduction": "mean", "per_layer": false},
 "registered_name": "keras_keepgrad>GradientNorm"},
{"module": "keras_keepgrad.metrics", "class_name": "GradientNorm",
 "config": {"name": "layer_norm", "reduction": "last", "per_layer": true},
 "registered_name": "keras_keepgrad>GradientNorm"},
{"module": "keras_keepgrad.metrics", "class_name": "GradientMaxAbs",
 "config": {"name": "grad_max_abs", "reduction": "max"},
 "registered_name": "keras_keepgrad>GradientMaxAbs"},
{"module": "keras_keepgrad.metrics", "class_name": "NonFiniteGradients",
 "config": {"name": "grad_nonfinite", "reduction": "sum"},
 "registered_name": "keras_keepgrad>NonFiniteGradients"},
{"module": "keras_keepgrad.metrics", "class_name": "VanishingGradients",
 "config": {"name": "grad_vanishing", "reduction": "mean", "threshold": 0.5},
 "registered_name": "keras_keepgrad>VanishingGradients"},
{"module": "keras_keepgrad.metrics", "class_name": "UpdateRatio",
 "config": {"name": "update_ratio", "reduction": "mean", "per_layer": true},
 "registered_name": "keras_keepgrad>UpdateRatio"},
{"module": "keras_keepgrad._dynamics", "class_name": "GradientNoiseScale",
 "config": {"name": "grad_noise_scale", "reduction": "last", "accumulation_steps": 2,
            "smoothing": 0.5, "components": true},
 "registered_name": "keras_keepgrad>GradientNoiseScale"},
{"module": "keras_keepgrad._dynamics", "class_name": "GradientSNR",
 "config": {"name": "grad_snr", "reduction": "mean", "accumulation_steps": 3,
            "per_layer": false},
 "registered_name": "keras_keepgrad>GradientSNR"},
{"module": "keras_keepgrad._dynamics", "class_name": "GradientCosine",
 "config": {"name": "grad_cosine", "reduction": "max", "per_layer": true},
 "registered_name": "keras_keepgrad>GradientCosine"}
]""")

SAVED_MODEL = os.path.join(os.path.dirname(__file__), "data", "metrics_before_package.keras")


def test_every_public_metric_is_in_the_saved_configs():
    classes = {config["class_name"] for config in SAVED}
    assert classes == set(kg.metrics.__all__) - {"GradientMetric"}


def test_configs_saved_before_the_move_load_as_the_same_metrics():
    for saved in SAVED:
        metric = keras.saving.deserialize_keras_object(saved)
        assert metric.__class__ is getattr(kg.metrics, saved["class_name"])
        again = keras.saving.serialize_keras_object(metric)
        assert again["registered_name"] == saved["registered_name"]
        assert again["config"] == saved["config"]
        # The module now written holds the class too.
        module = importlib.import_module(again["module"])
        assert getattr(module, saved["class_name"]) is metric.__class__


def _readable_here(path, tmp_path):
    """The saved file, or a copy an older Keras reads: the file was written
    by Keras 3.15, whose `Dense` config has `quantization_config`, a key
    Keras releases before it refuse (nothing to do with the metrics)."""
    if "quantization_config" in inspect.signature(keras.layers.Dense).parameters:
        return path
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(members["config.json"])

    def drop(node):
        if isinstance(node, dict):
            node.pop("quantization_config", None)
            for value in node.values():
                drop(value)
        elif isinstance(node, list):
            for value in node:
                drop(value)

    drop(config)
    members["config.json"] = json.dumps(config).encode()
    copy = tmp_path / "readable.keras"
    with zipfile.ZipFile(copy, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return str(copy)


def test_a_model_saved_before_the_move_loads_and_trains(tmp_path):
    model = keras.models.load_model(_readable_here(SAVED_MODEL, tmp_path))
    # Two steps were taken before saving: w = 0.75, gradient 5w = 3.75, and
    # SGD(0.1) halves w again (update ratio 0.5).
    np.testing.assert_array_equal(model.get_weights()[0], [[0.75]])
    history = model.fit(X, Y, batch_size=2, epochs=1, verbose=0).history
    # NaN as "nan", so that the dict compares.
    logs = {
        key: "nan" if np.isnan(values[0]) else values[0]
        for key, values in history.items()
        if key != "loss"
    }
    assert logs == {
        "grad_norm": 3.75,
        "layer_norm/dense_0": 3.75,
        "grad_max_abs": 3.75,
        "grad_nonfinite": 0.0,
        "grad_vanishing": 0.0,
        "update_ratio/dense_0": 0.5,
        # Their state is not saved: one step after loading gives no value.
        "grad_noise_scale": "nan",
        "grad_noise_scale/trace_cov": "nan",
        "grad_noise_scale/grad_sq": "nan",
        "grad_snr": "nan",
        "grad_cosine/dense_0": "nan",
    }
