"""Screenshots of TensorBoard's dashboards for the docs' pictures.

Trains the demo's two models (`python -m keras_keepgrad.demo`) and a third
run whose inputs turn NaN at step 35, starts `tensorboard` on their logs
(on 127.0.0.1 only), and photographs each dashboard with headless
Chromium (Debian's `chromium` package: `apt-get install chromium`). The
heatmap figures (`heatmap.png`: the demo's sigmoid model, whose first
layers' gradients vanish; `heatmap_nan.png`: the NaN run) are written
straight from the event files, at their own size; `tensorboard_images.png`
shows them as TensorBoard's Images tab does by default (scaled to its
card). `report.png` is `GradientReport`'s figure for the demo's sigmoid
model and `report_html.png` its HTML page in Chromium.

Usage:

```shell
python docs/screenshots.py                 # PNGs into docs/images/
python docs/screenshots.py --out /tmp/shots --logdir /tmp/logs
```
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# picture name: (the page's query and route in TensorBoard, virtual ms to
# wait). Time Series reads its settings from the query and draws with SVG
# when asked (`forceSVG`: headless Chromium has no WebGL); the older
# dashboards read theirs from the route.
DASHBOARDS = {
    "tensorboard_time_series": (
        "?forceSVG=true&smoothing=0&tagFilter=gradients%2Flog10_norm%2Fdense_#timeseries",
        120000,
    ),
    "tensorboard_scalars": (
        "#scalars&tagFilter=gradients%2Flog10_norm%2Fdense_&_smoothingWeight=0",
        20000,
    ),
    "tensorboard_custom_scalars": ("#custom_scalars&_smoothingWeight=0", 20000),
    "tensorboard_histograms": ("#histograms&tagFilter=dense_0/kernel/gradient", 20000),
    "tensorboard_images": ("?forceSVG=true&tagFilter=heatmap#timeseries", 30000),
}
# GradientReport's pages (the demo writes them): file name -> Chromium's window.
REPORT_PAGE = ("sigmoid_report.html", "report_html", 1200, 420)
REPORT_FIGURE = ("sigmoid_report.png", "report")
# Heatmap pictures: run -> file name.
HEATMAPS = {"sigmoid": "heatmap", "nan_at_35": "heatmap_nan"}


def nan_run(log_dir, nan_step=35, steps=50):
    """A sigmoid MLP whose batch `nan_step` (1-based) holds a NaN input."""
    import keras
    import numpy as np

    import keras_keepgrad as kg

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), name="x")
    h = inputs
    for i in range(4):
        h = keras.layers.Dense(16, activation="sigmoid", name=f"dense_{i}")(h)
    model = kg.KeepGradModel(inputs, keras.layers.Dense(1, name="out")(h), name="nan_at_35")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * steps, 8)).astype("float32")
    y = np.ones((64 * steps, 1), "float32")
    x[64 * (nan_step - 1) : 64 * nan_step] = np.nan
    model.fit(
        x,
        y,
        batch_size=64,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[
            kg.callbacks.GradientTensorBoard(log_dir, update_freq=1, histogram_freq=1),
            kg.callbacks.GradientMonitor(action="warn"),
        ],
    )


def make_logs(logdir):
    import warnings

    from keras_keepgrad import demo

    demo.main(["--logdir", logdir, "--quiet"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the monitor's NaN warning
        nan_run(os.path.join(logdir, "nan_at_35"))


def write_heatmaps(logdir, out):
    """Each run's last heatmap image, as the PNG TensorBoard shows."""
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator

    written = []
    for run, name in HEATMAPS.items():
        train = os.path.join(logdir, run, "train")
        if not os.path.isdir(train):
            continue
        acc = event_accumulator.EventAccumulator(train, size_guidance={"tensors": 0})
        acc.Reload()
        if "gradients/heatmap" not in acc.Tags()["tensors"]:
            continue
        _, _, png = tf.make_ndarray(acc.Tensors("gradients/heatmap")[-1].tensor_proto)
        path = os.path.join(out, f"{name}.png")
        with open(path, "wb") as f:
            f.write(png)
        written.append(path)
    return written


def write_reports(logdir, out, chromium):
    """The demo's `GradientReport` figure, and its page as Chromium shows it."""
    written = []
    name, picture = REPORT_FIGURE
    if os.path.exists(os.path.join(logdir, name)):
        shutil.copyfile(os.path.join(logdir, name), os.path.join(out, picture + ".png"))
        written.append(os.path.join(out, picture + ".png"))
    name, picture, width, height = REPORT_PAGE
    page = os.path.join(logdir, name)
    if os.path.exists(page):
        path = os.path.join(out, picture + ".png")
        screenshot(chromium, "file://" + os.path.abspath(page), path, width, height, 1000)
        written.append(path)
    return written


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(logdir, port, log_file):
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            logdir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast",
            "false",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 90
    while True:
        if server.poll() is not None:
            raise RuntimeError("tensorboard exited; see its log")
        try:
            with opener.open(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as r:
                if b"gradients/log10_norm/" in r.read():
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.terminate()
            raise RuntimeError("tensorboard did not serve the logs in 90 s")
        time.sleep(1)


def screenshot(chromium, url, path, width, height, wait_ms):
    profile = tempfile.mkdtemp(prefix="chromium_")
    try:
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--hide-scrollbars",
                f"--window-size={width},{height}",
                f"--virtual-time-budget={wait_ms}",
                f"--screenshot={path}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "images"))
    parser.add_argument("--logdir", help="train into (and keep) this directory")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    logdir = args.logdir or tempfile.mkdtemp(prefix="screenshots_")
    if not os.path.isdir(logdir) or not os.listdir(logdir):
        make_logs(logdir)
    for path in write_heatmaps(logdir, args.out) + write_reports(logdir, args.out, args.chromium):
        print(path)
    port = free_port()
    log_path = os.path.join(tempfile.gettempdir(), f"tensorboard_{port}.log")
    with open(log_path, "wb") as log_file:
        server = serve(logdir, port, log_file)
        try:
            for name, (route, wait_ms) in DASHBOARDS.items():
                path = os.path.join(args.out, name + ".png")
                screenshot(
                    args.chromium,
                    f"http://127.0.0.1:{port}/{route}",
                    path,
                    args.width,
                    args.height,
                    wait_ms,
                )
                print(path)
        finally:
            server.terminate()
            server.wait(timeout=30)
    if not args.logdir:
        shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    main()
