"""Makes the pictures in `docs/images/` from the demo's TensorBoard logs.

    python docs/make_images.py            # runs the demo into a temp dir
    python docs/make_images.py --logdir runs/demo   # reads an earlier run

`heatmap.png` is the `gradients/heatmap` image `GradientTensorBoard` wrote
for the sigmoid model, as TensorBoard shows it. `tensorboard_scalars.png`
plots the per-layer gradient norms (`gradients/layer_norm/<layer>`) of both
demo models on a log scale, as TensorBoard's "Gradient panels" chart does.
"""

import argparse
import io
import math
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402
from PIL import Image  # noqa: E402
from PIL import ImageDraw  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402

from keras_keepgrad import demo  # noqa: E402

IMAGES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "images")
PREFIX = "gradients/layer_norm/"


def read(run_dir):
    acc = event_accumulator.EventAccumulator(run_dir, size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def heatmap_png(acc):
    """The last heatmap's PNG bytes (an image summary: width, height, PNG)."""
    event = acc.Tensors("gradients/heatmap")[-1]
    return tf.make_ndarray(event.tensor_proto)[2]


def layer_norms(acc):
    """`{layer: [(step, norm), ...]}` in the order the layers were written."""
    tags = [t for t in acc.Tags()["tensors"] if t.startswith(PREFIX)]
    return {
        t[len(PREFIX) :]: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(t)]
        for t in tags
    }


def chart(draw, box, title, series, low, high):
    """One log-scale line chart of `series` inside `box` (x0, y0, x1, y1)."""
    x0, y0, x1, y1 = box
    draw.rectangle(box, outline=(120, 120, 120))
    draw.text((x0, y0 - 18), title, fill=(0, 0, 0))
    steps = [s for points in series.values() for s, _ in points]
    first, last = min(steps), max(steps)
    for decade in range(low, high + 1):
        y = y1 - (decade - low) / (high - low) * (y1 - y0)
        draw.line((x0, y, x1, y), fill=(225, 225, 225))
        draw.text((x0 - 44, y - 6), f"1e{decade}", fill=(80, 80, 80))
    for k, points in enumerate(series.values()):
        # Early layers blue, late ones red, as the heatmap's rows go.
        t = k / max(len(series) - 1, 1)
        color = (int(220 * t), 60, int(220 * (1 - t)))
        xy = [
            (
                x0 + (s - first) / max(last - first, 1) * (x1 - x0),
                y1 - (math.log10(max(v, 10.0**low)) - low) / (high - low) * (y1 - y0),
            )
            for s, v in points
        ]
        draw.line(xy, fill=color, width=2)
    draw.text((x0, y1 + 6), f"step {first}", fill=(80, 80, 80))
    draw.text((x1 - 60, y1 + 6), f"step {last}", fill=(80, 80, 80))


def scalars_png(runs):
    """Both runs' per-layer norms side by side, on one log scale."""
    values = [v for series in runs.values() for points in series.values() for _, v in points]
    low = math.floor(math.log10(max(min(values), 1e-12)))
    high = math.ceil(math.log10(max(values)))
    image = Image.new("RGB", (1000, 380), "white")
    draw = ImageDraw.Draw(image)
    for i, (name, series) in enumerate(runs.items()):
        x0 = 60 + i * 480
        title = f"{name}: gradients/layer_norm/<layer> (blue: first layer, red: last)"
        chart(draw, (x0, 40, x0 + 420, 340), title, series, low, high)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", help="the demo's --logdir; default: run the demo")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        logdir = args.logdir or tmp
        if not args.logdir and demo.main(["--logdir", logdir, "--quiet"]) != 0:
            return 1
        runs = {name: read(os.path.join(logdir, name, "train")) for name in ("sigmoid", "relu_bn")}
        os.makedirs(IMAGES, exist_ok=True)
        with open(os.path.join(IMAGES, "heatmap.png"), "wb") as f:
            f.write(heatmap_png(runs["sigmoid"]))
        with open(os.path.join(IMAGES, "tensorboard_scalars.png"), "wb") as f:
            f.write(scalars_png({name: layer_norms(acc) for name, acc in runs.items()}))
    print(f"wrote heatmap.png and tensorboard_scalars.png in {IMAGES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
