"""Pods in their JobSet's image: the sandbox's image runtime (`olmo-ctl sandbox --image-runtime buildah`).

`ImageRunner` is `pod_processes.ProcessRunner` with the container started from the pod's `image`
instead of this machine's virtual environment: a working container of the local image (`buildah from
--pull-never`), its command run with `buildah run --isolation chroot`, as the pod's
`securityContext.runAsUser` or else the image's USER, in the container's `workingDir` or else the
image's WORKDIR, with the image's environment plus the container's `env`, the TPU webhook's variables
and the emulated TPU VM's (all as the process runtime computes them), and of the sandbox's own
environment only the GCS emulator's variables (`gcs_emulator.ENV_KEYS`, standing in for the pod's
Workload Identity on GCS). A chroot shares this machine's network and process IDs, so the coordinator
address and the emulator's URL are the same inside, and the runner signals the container's main
process itself: a pod's deletion is SIGTERM to it (buildah would SIGKILL it), the grace period's end
SIGKILL to the process group. Its exit code is the container's (buildah's status line, `subprocess
exited on terminated` -> 143), and buildah's own lines are left out of the pod's log. The working
container is removed once the pod's process is gone.

An image not in local storage is the kubelet's `ErrImagePull`: the pod is bound to its node and
waits with that reason and a `Failed` event, as on GKE, and runs nothing. A JobSet whose run directory
is not on gs:// is refused: a container sees the GCS emulator, not this machine's files.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from olmo_ctl.sandbox import buildah
from olmo_ctl.sandbox.gcs_emulator import ENV_KEYS as GCS_ENV_KEYS
from olmo_ctl.sandbox.pod_processes import WEBHOOK, PodProcess, ProcessRunner

if TYPE_CHECKING:
    from olmo_ctl.sandbox.sandbox import SandboxWorld

# buildah's own lines on the container's stderr: the exit status it saw, then its error.
_STATUS = re.compile(r"^subprocess exited (?:with status (\d+)|on (.+))$")
_BUILDAH_ERROR = re.compile(r"^Error: exit status \d+$")
# Go's names of the signals a container can die of (syscall.Signal.String()).
_GO_SIGNALS = {
    "hangup": signal.SIGHUP,
    "interrupt": signal.SIGINT,
    "quit": signal.SIGQUIT,
    "illegal instruction": signal.SIGILL,
    "trace/breakpoint trap": signal.SIGTRAP,
    "aborted": signal.SIGABRT,
    "bus error": signal.SIGBUS,
    "floating point exception": signal.SIGFPE,
    "killed": signal.SIGKILL,
    "user defined signal 1": signal.SIGUSR1,
    "segmentation fault": signal.SIGSEGV,
    "user defined signal 2": signal.SIGUSR2,
    "broken pipe": signal.SIGPIPE,
    "alarm clock": signal.SIGALRM,
    "terminated": signal.SIGTERM,
}
PULL_ERROR = "ErrImagePull"


def status_exit_code(line: str) -> int | None:
    """The container's exit code from buildah's status line (128 + N for signal N), or None."""
    m = _STATUS.match(line.strip())
    if m is None:
        return None
    if m.group(1) is not None:
        return int(m.group(1))
    sig = _GO_SIGNALS.get(m.group(2))
    return 128 + int(sig) if sig is not None else 128


def run_as(pod: dict, container: dict) -> str | None:
    """`uid[:gid]` of the pod's securityContext (the container's over the pod's), or None: the image's."""
    ctx = {**(pod["spec"].get("securityContext") or {}), **(container.get("securityContext") or {})}
    uid, gid = ctx.get("runAsUser"), ctx.get("runAsGroup")
    if uid is None:
        return None
    return f"{uid}:{gid}" if gid is not None else str(uid)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def container_main_pid(buildah_pid: int) -> int | None:
    """The container's main process under `buildah run`: the first process below buildah's own
    (`buildah`, `buildah-chroot-runtime`, `memfd:buildah-c...`) that is not buildah's."""
    pid = buildah_pid
    for _ in range(8):
        kids = children(pid)
        if not kids:
            return None
        pid = kids[0]
        if "buildah" not in _comm(pid):
            return pid
    return None


class ImageRunner(ProcessRunner):
    """The sandbox's kubelet for pods in their image (see the module's docstring)."""

    def __init__(self, log: Callable[[str], None] | None = None, **kw):
        super().__init__(log=log, **kw)
        self.containers: dict[str, str] = {}  # pod uid -> its working container
        self.made: list[str] = []  # every working container it made (tests: each is removed)
        self.statuses: dict[str, int] = {}  # pod uid -> the exit code buildah reported
        self.main_pids: dict[str, int] = {}
        self._closing = False
        self._removing: list[threading.Thread] = []

    def admit(self, world: SandboxWorld, jobset: dict) -> None:
        from olmo_ctl.backends.jobset import ANNOTATION_RUN_DIR
        from olmo_ctl.sandbox.kube_api import ApiError

        run_dir = ((jobset.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RUN_DIR)
        if run_dir and not run_dir.startswith("gs://"):
            why = (
                f"JobSet {jobset['metadata'].get('name')} writes its run to {run_dir}, which a container "
                "of the image cannot see: use a gs:// run root (start the sandbox with --gcs-bucket)"
            )
            self.log(f"refused {why}")
            raise ApiError(400, "BadRequest", f'admission webhook "{WEBHOOK}" denied the request: {why}')
        super().admit(world, jobset)

    def start(self, world: SandboxWorld, pod: dict, node: str) -> None:
        md = pod["metadata"]
        container = (pod["spec"].get("containers") or [{}])[0]
        image = str(container.get("image") or "")
        try:
            if not image:
                raise buildah.BuildahError("the container names no image")
            ctr = buildah.from_image(image, name=f"olmo-ctl-pod-{md['uid'][:8]}-{md['name'][-40:]}")
        except buildah.BuildahError as e:
            self.pull_failed(world, pod, node, image, e.message)
            return
        self.containers[md["uid"]] = ctr
        self.made.append(ctr)
        super().start(world, pod, node)
        if md["uid"] not in self.procs:  # it did not start: StartError, already reported
            self._remove(md["uid"])

    def pull_failed(self, world: SandboxWorld, pod: dict, node: str, image: str, why: str) -> None:
        """The kubelet cannot pull the image: the pod is bound and waits on ErrImagePull."""
        world.start_pod(pod, node)
        st = pod["status"]
        st["phase"] = "Pending"
        for cond in st.get("conditions") or []:
            if cond["type"] in ("ContainersReady", "Ready"):
                cond.update(status="False", reason="ContainersNotReady")
        message = f'failed to pull and unpack image "{image}": {why}'
        for cs in st.get("containerStatuses") or []:
            cs.update(
                ready=False, started=False, state={"waiting": {"reason": PULL_ERROR, "message": message}}
            )
        world.save("Pod", pod)
        world.event(pod, "Failed", f"Failed to pull image: {message}", "Warning")
        self.log(f"pod {pod['metadata']['name']} on {node}: {PULL_ERROR}: {message}")

    # -- the container in its image
    def launch(self, world: SandboxWorld, pod: dict, container: dict) -> tuple[list[str], dict, str | None]:
        argv = [str(a) for a in list(container.get("command") or []) + list(container.get("args") or [])]
        if not argv:
            raise ValueError("the container has no command (this runtime runs only a pod's own command)")
        ctr = self.containers[pod["metadata"]["uid"]]
        env = self.environment(world, pod, container)
        cmd = buildah.run_argv(
            ctr, argv, user=run_as(pod, container), working_dir=container.get("workingDir"), env=env
        )
        return cmd, dict(os.environ), None

    def host_env(self) -> dict[str, str]:
        source = os.environ if self.base_env is None else self.base_env
        return {k: source[k] for k in GCS_ENV_KEYS if k in source}

    def main_pid(self, proc: PodProcess) -> int:
        pid = self.main_pids.get(proc.uid) or container_main_pid(proc.popen.pid)
        if pid is None:
            return proc.popen.pid  # not started yet: buildah ends it
        self.main_pids[proc.uid] = pid
        return pid

    def log_line(self, proc: PodProcess, line: str) -> str | None:
        code = status_exit_code(line)
        if code is not None:
            self.statuses.setdefault(proc.uid, code)  # the first: on a signal, a second says status 1
            return None
        if _BUILDAH_ERROR.match(line.strip()):
            return None
        return line

    def exit_code(self, proc: PodProcess, returncode: int) -> int:
        if returncode < 0:  # buildah itself was killed (a grace period's end): so was its group
            return super().exit_code(proc, returncode)
        return self.statuses.get(proc.uid, returncode)

    def ended(self, proc: PodProcess) -> None:
        self.statuses.pop(proc.uid, None)
        self.main_pids.pop(proc.uid, None)
        ctr = self.containers.pop(proc.uid, None)
        if ctr and self._closing:
            buildah.remove_container(ctr)
        elif ctr:
            # Off the store's lock: removing a container's layer takes a moment.
            t = threading.Thread(target=buildah.remove_container, args=(ctr,), daemon=True)
            t.start()
            self._removing.append(t)

    def _remove(self, uid: str) -> None:
        ctr = self.containers.pop(uid, None)
        if ctr:
            buildah.remove_container(ctr)

    def close(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        super().close(timeout_s)
        for uid in list(self.containers):
            self._remove(uid)
        for t in self._removing:
            t.join(timeout_s)
