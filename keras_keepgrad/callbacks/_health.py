"""Where a layer's gradient norm counts as vanishing or exploding.

One definition for `GradientMonitor`'s defaults, `GradientReport`'s
verdicts and the marks on `GradientTensorBoard`'s heatmap color bar, and
the heatmap's fixed color scale, so that a color, a verdict and an alarm
mean the same norm in every run.
"""

# A layer whose gradient L2 norm is below this learns next to nothing: with
# a learning rate of 1e-3 its weights move by about 1e-8 per step.
VANISHING_THRESHOLD = 1e-5
# A norm above this moves weights by about 1 per step at a learning rate of
# 1e-3: the next steps overflow or diverge.
EXPLODING_THRESHOLD = 1e3
# The heatmap's log10 color scale: 1e-8 .. 1e4, the same for every run.
# Below and above are clipped to the end colors and hatched.
LOG10_RANGE = (-8.0, 4.0)


def verdict(mean_norm, nonfinite_steps=0):
    """`"non-finite"`, `"vanishing"`, `"exploding"` or `"ok"`."""
    if nonfinite_steps:
        return "non-finite"
    if mean_norm < VANISHING_THRESHOLD:
        return "vanishing"
    if mean_norm > EXPLODING_THRESHOLD:
        return "exploding"
    return "ok"
