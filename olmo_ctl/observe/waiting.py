"""Why a live attempt waits, in one line: what `runs` and `monitor` print for it.

The backend's typed status says what holds the attempt (`AttemptStatus.hold`: its kind, its
source's words, who said them); this module words it the one way both commands print it:

    waiting for quota: insufficient unused quota for google.com/tpu in flavor v5p-16, 16 more needed (Kueue)
    unschedulable: 0/2 nodes are available: 2 Insufficient google.com/tpu. ... (scheduler)
    image pull back-off: us-docker.pkg.dev/p/r/olmo-ctl:0.1.0 (kubelet)

and names its `cause` in the words of the supervisor's journaled waits (`waiting` records:
queued, requeued, admission-checks, unschedulable, node-not-ready, kubelet-admission), plus
`image-pull` (a bounded wait), `deactivated`, `pods-refused`, `stale-selector` (a node selector left
by an earlier admission on another flavor) and `config-error` (what no capacity changes: no flavor
fits, no such queue, an image that cannot be pulled).
"""

from __future__ import annotations

from olmo_ctl.backends.base import AttemptStatus

# Hold kind -> (how the line starts, the wait's cause)
KINDS: dict[str, tuple[str, str]] = {
    "quota": ("waiting for quota", "queued"),
    "queued": ("queued", "queued"),
    "admission-check": ("waiting for admission checks", "admission-checks"),
    "requeued": ("requeued", "requeued"),
    "deactivated": ("deactivated", "deactivated"),
    "no-flavor": ("no flavor fits", "config-error"),
    "no-queue": ("no such queue", "config-error"),
    "no-workload": ("not queued", "config-error"),
    "unschedulable": ("unschedulable", "unschedulable"),
    "node-not-ready": ("node not ready", "node-not-ready"),
    "kubelet-admission": ("kubelet refused a pod", "kubelet-admission"),
    "image-pull": ("image pull back-off", "image-pull"),
    "bad-image": ("image cannot be pulled", "config-error"),
    "pods-refused": ("pods refused", "pods-refused"),
    # Not capacity: a node selector left from another flavor (jobset#1294); --admission-timeout applies.
    "stale-selector": ("stale node selector", "stale-selector"),
}

# The causes that are waits for capacity: the supervisor waits them out, with no admission timeout
# (`supervise.policy.waiting_for`); an image pull is a bounded wait of its own.
CAPACITY_CAUSES = frozenset(
    {"queued", "requeued", "admission-checks", "unschedulable", "node-not-ready", "kubelet-admission"}
)


def wait_of(st: AttemptStatus | None) -> tuple[str, str, str] | None:
    """(cause, kind, line) of what holds a live attempt, from its backend's status; None when nothing
    does (it runs, its pods are starting, it is over, or the backend does not say)."""
    if st is None or not st.state.live or st.hold is None:
        return None
    h = st.hold
    label, cause = KINDS.get(h.kind, (h.kind, h.kind))
    message = " ".join(h.message.split())  # one line, whatever the source wrapped
    return cause, h.kind, f"{label}: {message} ({h.by})" if message else f"{label} ({h.by})"


def journal_line(cause: str, reason: str) -> str:
    """The line for a wait only the journal knows of (the backend was not asked): the supervisor's
    `waiting` record."""
    why = " ".join((reason or "").split())
    return f"waiting for capacity ({cause})" + (f": {why}" if why else "") + " (journal)"
