"""The public surface, exactly: names, signatures and the model's members."""

import inspect
import types

import keras

import keras_keepgrad as kg

SURFACE = {
    kg: ["KeepGradModel", "SkipBadSteps", "callbacks", "keep_gradients", "metrics", "replay_batch"],
    kg.metrics: [
        "GradientCosine",
        "GradientMaxAbs",
        "GradientMetric",
        "GradientNoiseScale",
        "GradientNorm",
        "GradientSNR",
        "NonFiniteGradients",
        "UpdateRatio",
        "VanishingGradients",
    ],
    kg.callbacks: [
        "EXPLODING_THRESHOLD",
        "VANISHING_THRESHOLD",
        "GradientMonitor",
        "GradientReport",
        "GradientSnapshot",
        "GradientTensorBoard",
    ],
}

SIGNATURES = {
    kg.KeepGradModel.__init__: (
        "(self, *args, keep_gradients=True, save_gradients=False, keep_every=1, "
        "skip_bad_steps=None, **kwargs)"
    ),
    kg.SkipBadSteps: (
        "(nonfinite=True, spike_factor=None, window=100, save_batches_to=None, max_saved=10, "
        "skip=True, updates_per_step=1)"
    ),
    kg.replay_batch: "(model, path)",
    kg.keep_gradients: "(model, **options)",
    kg.KeepGradModel.keep_step_gradients: "(self, grads, variables)",
    kg.KeepGradModel.get_gradients_of: "(self, layer)",
    kg.metrics.GradientMetric: "(fn, name=None, reduction='mean', **kwargs)",
    kg.metrics.GradientNorm: "(per_layer=False, name='grad_norm', reduction='mean', **kwargs)",
    kg.metrics.GradientMaxAbs: "(name='grad_max_abs', reduction='max', **kwargs)",
    kg.metrics.NonFiniteGradients: "(name='grad_nonfinite', reduction='sum', **kwargs)",
    kg.metrics.VanishingGradients: (
        "(threshold=1e-07, name='grad_vanishing', reduction='mean', **kwargs)"
    ),
    kg.metrics.UpdateRatio: "(per_layer=False, name='update_ratio', reduction='mean', **kwargs)",
    kg.metrics.GradientNoiseScale: (
        "(accumulation_steps=4, smoothing=0.9, components=False, name='grad_noise_scale', "
        "reduction='last', **kwargs)"
    ),
    kg.metrics.GradientSNR: (
        "(per_layer=True, accumulation_steps=4, name='grad_snr', reduction='mean', **kwargs)"
    ),
    kg.metrics.GradientCosine: "(per_layer=False, name='grad_cosine', reduction='mean', **kwargs)",
    kg.callbacks.GradientTensorBoard: (
        "(log_dir='logs', histogram_freq=0, update_freq='epoch', write_heatmap=True, "
        "gradient_histogram_freq=None, **kwargs)"
    ),
    kg.callbacks.GradientMonitor: (
        "(action='warn', check_nonfinite=True, min_loss_scale=1.0, vanishing_threshold=1e-05, "
        "vanishing_steps=10, exploding_threshold=1000.0, exploding_factor=None, "
        "median_window=100, check_freq=1, recovery_steps=10, check_skipped=True)"
    ),
    kg.callbacks.GradientReport: "(print_table=True, png=None, html=None, title=None)",
    kg.callbacks.GradientSnapshot: "(path, every='epoch')",
}


def _public(module):
    """Public names defined in this package (not modules, not imported helpers)."""
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", "").startswith("keras_keepgrad")
    }


def test_all_is_exactly_the_public_surface():
    for module, names in SURFACE.items():
        assert module.__all__ == names, module.__name__
        for name in names:
            assert getattr(module, name) is not None, name
    assert _public(kg) | {"callbacks", "metrics"} == set(SURFACE[kg])
    # The thresholds are floats, which name no module.
    thresholds = {"EXPLODING_THRESHOLD", "VANISHING_THRESHOLD"}
    assert _public(kg.callbacks) | thresholds == set(SURFACE[kg.callbacks])
    assert (kg.callbacks.VANISHING_THRESHOLD, kg.callbacks.EXPLODING_THRESHOLD) == (1e-5, 1e3)
    # `build_gradient_metrics` is the model's hook into this module, not for users.
    assert _public(kg.metrics) - set(SURFACE[kg.metrics]) == {"build_gradient_metrics"}


def _unannotated(target):
    """The signature's names, kinds and defaults; type hints may change."""
    signature = inspect.signature(target)
    empty = inspect.Parameter.empty
    parameters = [p.replace(annotation=empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=empty))


def test_signatures_are_exactly_the_documented_ones():
    for target, expected in SIGNATURES.items():
        assert _unannotated(target) == expected, target


def test_the_model_members_and_base_classes():
    assert issubclass(kg.KeepGradModel, keras.Model)
    for name in (
        "gradients",
        "gradient_dtypes",
        "keep_gradients",
        "save_gradients",
        "keep_every",
        "skip_bad_steps",
        "first_bad_replica",
    ):
        assert name in dir(kg.KeepGradModel), name
    assert callable(kg.KeepGradModel.get_gradients_by_path)
    assert callable(kg.KeepGradModel.get_gradients_of)
    assert callable(kg.KeepGradModel.keep_step_gradients)
    assert issubclass(kg.callbacks.GradientTensorBoard, keras.callbacks.TensorBoard)
    for name in ("GradientMonitor", "GradientReport", "GradientSnapshot"):
        assert issubclass(getattr(kg.callbacks, name), keras.callbacks.Callback), name
    for name in SURFACE[kg.metrics]:
        assert issubclass(getattr(kg.metrics, name), keras.metrics.Metric), name
