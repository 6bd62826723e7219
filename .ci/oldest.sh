#!/usr/bin/env bash
# The oldest tested set (README's "Tested with"): in a fresh venv, install it
# as a user would have it, then this package, and check that installing the
# package moved none of it; run the library's fast tests (`-m "not slow"`)
# where Keras's internals meet it on TensorFlow (in its default mode on a
# CPU), and those of JAX and PyTorch (their own directories). CI's full
# suite covers the newest set.
#
# `oldest.sh prepare DIR` makes and checks the venv in DIR, `oldest.sh test
# DIR` runs the suite in it (.ci/run prepares beside the fresh-venv demo,
# before the main suite, and tests after it); `oldest.sh` alone does both.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
start=$SECONDS
step="${1:-all}"
case "$step:${2:-}" in
all:)
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    ;;
prepare:?* | test:?*) work="$2" ;;
*)
    echo "usage: oldest.sh [prepare DIR | test DIR]; received: $*" >&2
    exit 2
    ;;
esac
prepare() {
    python3 -m venv "$work/venv"
    # shellcheck disable=SC1091
    source "$work/venv/bin/activate"
    export PIP_QUIET=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
    # torch==2.13.0 is the CPU wheel this machine carries (a bare `torch` would
    # take the multi-GB CUDA build).
    oldest=(keras==3.10.0 tensorflow-cpu==2.19.0 tensorboard==2.19.0 jax==0.6.0 jaxlib==0.6.0 torch==2.13.0)
    python -m pip install "${oldest[@]}"
    versions() {
        python -c 'import importlib.metadata as m, sys; print(*(n + "==" + m.version(n) for n in sys.argv[1:]))' \
            keras tensorflow-cpu tensorboard jax jaxlib torch numpy
    }
    before="$(versions)"
    # `test`: pytest, and the JAX and PyTorch the backend suites need.
    python -m pip install -e "$repo[cpu,test]"
    if [ "$(versions)" != "$before" ]; then
        echo "installing keras_keepgrad moved: $before -> $(versions)" >&2
        exit 1
    fi
    echo "oldest set, unmoved by the install: $before ($((SECONDS - start)) s)"
}
if [ "$step" = test ]; then
    # shellcheck disable=SC1091
    source "$work/venv/bin/activate"
else
    prepare
fi
[ "$step" = prepare ] && exit 0
cd "$repo"
# The library's tests where Keras's internals meet it (not those of the
# repository and its tools, made on the newest set): what is kept and how
# (test_model, test_capture), saving, the optimizers' updates and skipping,
# the metrics, the version checks and TensorBoard's tags. The statistics,
# dynamics and callbacks read `model.gradients` and run on the newest set.
# A test run in every mode runs in TensorFlow's default on a CPU, a
# `tf.function` without XLA (`graph`): Keras's step is the same Python in
# the three, and the tests written for XLA run as they are
# (tests/conftest.py's KEEPGRAD_TEST_MODES).
KEEPGRAD_TEST_MODES=graph python -m pytest -q -n auto -m "not slow" -p no:cacheprovider \
    tests/test_model.py tests/test_capture.py tests/test_saving.py tests/test_skipping.py \
    tests/test_metrics.py tests/test_compat.py tests/test_versions.py \
    tests/callbacks/test_tensorboard.py
# JAX and PyTorch: their own directories on the oldest set. The whole
# contract on Keras 3.10's JAX trainer still fails three tests (a snapshot,
# an optional input fed None from a generator, the nested-batch message):
# to be examined before it runs here. The two run side by side, one process
# each: a few dozen tests apiece, which two workers each would spend mostly
# starting.
KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=2 \
    python -m pytest -q -n 0 -m "not slow" -p no:cacheprovider tests/jax_backend \
    >"$work/jax.log" 2>&1 &
jax=$!
# `jit_compile=True` on PyTorch needs Keras 3.12+ beside PyTorch 2.13: plain
# Keras 3.10's compiled step fails in TorchDynamo (docs/backends.md).
KERAS_BACKEND=torch \
    python -m pytest -q -n 0 -m "not slow" -p no:cacheprovider -k "not jit" \
    tests/torch_backend >"$work/torch.log" 2>&1 &
torch=$!
failed=0
for backend in jax torch; do
    wait "${!backend}" || failed=1
    cat "$work/$backend.log"
done
[ "$failed" = 0 ]
done="installed and tested"
[ "$step" = test ] && done="tested"
echo "oldest set: $done in $((SECONDS - start)) s"
