# %% [markdown]
# # Saving, with and without the kept gradients
#
# By default the kept gradients stay out of every saved artifact: a
# `KeepGradModel`'s `.keras` archive and `.weights.h5` file hold exactly the
# arrays of the equivalent `keras.Model`, so weights move freely between the
# two. With `save_gradients=True` Keras's own files also carry the last kept
# gradients, and `keras.models.load_model` / `load_weights` restore them:
# handy to ship "the batch where it went wrong" to a colleague.
#
# Run: `python tutorials/saving.py` (`--fast` is accepted; it is fast anyway).

# %%
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import h5py  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

workdir = tempfile.mkdtemp()
x = np.array([[1.0], [2.0]], dtype="float32")
y = np.zeros((2, 1), dtype="float32")


def one_weight_model(**options):
    inputs = keras.Input((1,))
    dense = keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0), name="dense_0"
    )
    return kg.KeepGradModel(inputs, dense(inputs), **options)


def h5_arrays(path):
    """Every dataset in an .h5 file, by its path."""
    found = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            found[name] = obj[()]

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


# %% [markdown]
# ## Default: gradients are not saved
# One SGD(0.1) step on the one-weight model: kept gradient `5w = 15`, new
# weight `1.5`. The weights file holds the kernel and the optimizer's two
# scalars (iteration count and learning rate), and no gradient.

# %%
model = one_weight_model()
model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
model.fit(x, y, batch_size=2, verbose=0)
print("kept:", np.asarray(model.gradients["dense_0"]["kernel"]).tolist())
model.save_weights(os.path.join(workdir, "kept.weights.h5"))
arrays = h5_arrays(os.path.join(workdir, "kept.weights.h5"))
print("arrays in the weights file:", {k: v.tolist() for k, v in arrays.items()})
assert arrays["layers/dense/vars/0"].tolist() == [[1.5]]
assert sorted(v.tolist() for v in arrays.values() if v.ndim == 0) == [0.10000000149011612, 1]
assert len(arrays) == 3 and not [k for k in arrays if "grad" in k]

# %% [markdown]
# The same file loads into a plain `keras.Model`, and back.

# %%
inputs = keras.Input((1,))
plain = keras.Model(inputs, keras.layers.Dense(1, use_bias=False, name="dense_0")(inputs))
plain.load_weights(os.path.join(workdir, "kept.weights.h5"))
print("plain model's weight:", plain.get_weights()[0].tolist())
assert plain.get_weights()[0].tolist() == [[1.5]]

# %% [markdown]
# ## `save_gradients=True`: the gradients travel with the model

# %%
model = one_weight_model(save_gradients=True)
model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
model.fit(x, y, batch_size=2, verbose=0)
path = os.path.join(workdir, "with_gradients.keras")
model.save(path)
restored = keras.models.load_model(path)  # no custom_objects needed
print("restored type:", type(restored).__name__, "| save_gradients:", restored.save_gradients)
print("restored kept gradient:", np.asarray(restored.gradients["dense_0"]["kernel"]).tolist())
assert np.asarray(restored.gradients["dense_0"]["kernel"]).tolist() == [[15.0]]

# %% [markdown]
# ## A plain model's archive becomes a `KeepGradModel`

# %%
plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
plain.save(os.path.join(workdir, "plain.keras"))
kept = kg.keep_gradients(keras.models.load_model(os.path.join(workdir, "plain.keras")))
kept.fit(x, y, batch_size=2, verbose=0)
print(
    "gradient after loading a plain archive:",
    np.asarray(kept.gradients["dense_0"]["kernel"]).tolist(),
)
assert np.asarray(kept.gradients["dense_0"]["kernel"]).tolist() == [[7.5]]  # 5 * 1.5
