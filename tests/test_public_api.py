"""Every public name imports, and `__all__` is exactly the public surface."""

import keras_keepgrad as kg


def test_every_public_name_imports():
    for name in kg.__all__:
        assert getattr(kg, name) is not None, name


def test_all_lists_the_contract_names():
    contract = {"KeepGradModel", "keep_gradients", "metrics", "callbacks"}
    assert contract <= set(kg.__all__)
    assert {"GradientMetric", "GradientNorm"} <= set(kg.metrics.__all__)
    assert {"GradientTensorBoard"} <= set(kg.callbacks.__all__)
