"""The benchmarks' models, as `build()` functions returning `(inputs,
outputs)` of a functional model. Keras only, so that every backend's
benchmark builds the same models (`overhead_variants` on TensorFlow,
`overhead_backends` on JAX and PyTorch)."""

import keras


def mlp(width_in, hidden, classes):
    def build():
        inputs = keras.Input((width_in,))
        h = inputs
        for i, units in enumerate(hidden):
            h = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(h)
        return inputs, keras.layers.Dense(classes, name="logits")(h)

    return build


def conv(size, filters, dense):
    def build():
        inputs = keras.Input((size, size, 3))
        h = inputs
        for i, f in enumerate(filters):
            h = keras.layers.Conv2D(f, 3, activation="relu", name=f"conv_{i}")(h)
            h = keras.layers.MaxPooling2D(name=f"pool_{i}")(h)
        h = keras.layers.Flatten()(h)
        h = keras.layers.Dense(dense, activation="relu", name="dense")(h)
        return inputs, keras.layers.Dense(10, name="logits")(h)

    return build


def embedding(vocab, dim, length):
    def build():
        inputs = keras.Input((length,), dtype="int32")
        h = keras.layers.Embedding(vocab, dim, name="embedding")(inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
        h = keras.layers.Dense(64, activation="relu", name="dense")(h)
        return inputs, keras.layers.Dense(10, name="logits")(h)

    return build
