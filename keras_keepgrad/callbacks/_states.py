"""`GradientMonitor`'s states: a problem from the check that finds it to its end.

A state begins at a check that finds its problem (`States.begin`), is
extended by each later check that finds it again (`persist`), and ends
once `recovery_steps` checks in a row were free of it (`recover`). Each
begin and end is handed to the monitor's `report(kind, layers, text,
**extra)`, which words, records and acts on it.
"""

__all__ = ["KINDS", "States", "lasted"]

# Each kind's name in the summary, and what its end says.
KINDS = {
    "nonfinite": ("non-finite", "gradients are finite again"),
    "vanishing": ("vanishing", None),
    "exploding": ("exploding", "the global norm is back within bounds"),
    "skipped": ("skipped", "no step read was skipped"),
}


def lasted(since, until, checks):
    plural = "" if checks == 1 else "s"
    return f"steps {since}-{until} ({checks} check{plural})"


class States:
    """The states of one `fit`, in the order they began.

    Args:
        recovery_steps: Int. Checks in a row free of a problem that end its
            state.
        report: The monitor's report of a state's begin or end.
    """

    def __init__(self, recovery_steps, report):
        self.recovery_steps = recovery_steps
        self._report = report
        self.all = []
        # The open state of each kind that has one at a time (vanishing
        # layers have one each, kept by the monitor).
        self._open = {"nonfinite": None, "exploding": None, "skipped": None}

    def persist(self, kind, step):
        """Whether a `kind` state is open; if so, this check extends it."""
        state = self._open[kind]
        if state is None:
            return False
        self.extend(state, step)
        return True

    @staticmethod
    def extend(state, step):
        """A check found the problem of `state` again, at `step`."""
        state["until"] = step
        state["checks"] += 1
        state["_clear"] = 0

    def clear(self, state):
        """A check free of the problem of `state`; whether it ends now."""
        state["_clear"] += 1
        return state["_clear"] >= self.recovery_steps

    def recover(self, kind):
        """A check free of `kind`: its open state ends after enough of them."""
        state = self._open[kind]
        if state is not None and self.clear(state):
            self._open[kind] = None
            self.end(state, KINDS[kind][1])

    def begin(self, kind, layers, since, step, text, per_layer=False):
        """Opens a state (one per layer with `per_layer`) and reports it."""
        groups = [[layer] for layer in layers] if per_layer else [list(layers)]
        states = []
        for group in groups:
            state = {
                "kind": kind,
                "layers": group,
                "since": since,
                "until": step,
                "checks": 1,
                "ongoing": True,
                "_clear": 0,
            }
            self.all.append(state)
            states.append(state)
        if not per_layer:
            self._open[kind] = states[0]
        self._report(kind, layers, text, since=since)
        return states

    def end(self, state, text):
        state["ongoing"] = False
        since, until, checks = state["since"], state["until"], state["checks"]
        self._report(
            state["kind"] + "_ended",
            state["layers"],
            f"{text} for {self.recovery_steps} checks in a row: the state lasted "
            f"{lasted(since, until, checks)}.",
            since=since,
            until=until,
            checks=checks,
        )

    def finish(self):
        """At the end of `fit`: the states as `monitor.states` shows them."""
        for state in self.all:
            state.pop("_clear", None)

    def summary(self, first_step):
        """One line per state; `first_step`: the first step checked."""
        if not self.all:
            return "no non-finite, vanishing or exploding gradients"
        lines = []
        for state in self.all:
            names = ", ".join(repr(layer) for layer in state["layers"])
            whole = ", the whole run" if state["ongoing"] and state["since"] == first_step else ""
            end = f", until the end{whole}" if state["ongoing"] else ""
            lines.append(
                f"{names} {KINDS[state['kind']][0]}: "
                f"{lasted(state['since'], state['until'], state['checks'])}{end}"
            )
        return "\n".join(lines)
