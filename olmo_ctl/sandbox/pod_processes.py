"""Pods as local processes: the sandbox's kubelet and container runtime (`ProcessRunner`).

A pod the sandbox's scheduler binds to a node starts as one local process (its own session and
process group) running the pod's first container as the rendered manifest says: `command` + `args`
(`python`, `python3` or a path ending in `/python*` is this interpreter, `sys.executable`), in the
sandbox's environment (so STORAGE_EMULATOR_HOST, PYTHONPATH, ... reach it), plus the container's
`env` (`value`, with `$(VAR)` references to the variables before it expanded as the kubelet expands
them, or `valueFrom.fieldRef` on the pod's name, namespace, node, IP, labels and annotations), plus
what GKE would add:

- the TPU webhook, for a pod of an Indexed Job that requests google.com/tpu: `TPU_WORKER_ID` (its
  completion index) and `TPU_WORKER_HOSTNAMES` (`<job>-<i>.<subdomain>` for every index of its Job);
  for a JobSet of several slices, `MEGASCALE_NUM_SLICES`, `MEGASCALE_SLICE_ID` and
  `MEGASCALE_COORDINATOR_ADDRESS` where the manifest does not set them;
- the "TPU VM" or GPU node it lands on, emulated: `JAX_PLATFORMS=cpu` and
  `XLA_FLAGS=--xla_force_host_platform_device_count=D` (D: the node's JAX devices, its TPU chips times
  the generation's devices per chip, or its GPUs), and `OLMO_CTL_COORDINATOR_ADDRESS=127.0.0.1:<port>`,
  one free port per JobSet and restart, where the trainer's process 0 serves `jax.distributed`'s
  coordinator;
- the pod network, for a GPU pod's coordinator (`JAX_COORDINATOR_ADDRESS` and `JAX_COORDINATOR_PORT`,
  as the GPU JobSet sets them): every pod here is this machine, so a name the cluster's DNS resolves
  (`<hostname>.<subdomain>`, the pod of a JobSet's headless service, while that pod exists) becomes
  127.0.0.1 and the port that JobSet's coordinator port above (pods sharing one machine cannot each
  listen on 6002). A name no pod answers to is left as it is: the trainer cannot join, as on a
  cluster.

A sidecar (an init container with `restartPolicy: Always`, such as GPUDirect-TCPXO's `tcpxo-daemon`)
runs no process: what it serves on a GPU node (the receive data path of the node's NICs) has nothing
to serve on this machine, whose trainers join over gloo. It is started before the regular container
and stopped after it as the kubelet does (`World.start_pod`, `World.container_exit`), and its log says
so (`kubectl logs POD -c NAME`).

The process's stdout and stderr are the pod's log (`kubectl logs`). Its exit is the container's:
the exit code (128 + N for a signal N, as a container runtime reports it) becomes the pod's and the
upstream rules compute the Job's and JobSet's outcome. Deleting a pod sends SIGTERM to the process
and, when its grace period (`terminationGracePeriodSeconds`, or the delete's own) ends, SIGKILL to its
process group; a pod that ends without its process exiting (a lost node, a force delete with grace 0)
has its process group SIGKILLed at once, and so is what the main process leaves behind when it
exits (a container ends with its main process). A command that cannot start fails the pod with exit
128 (`StartError`).

Every pod of a JobSet runs on this one machine, so a JobSet of olmo-ctl's trainer whose model cannot
fit here is refused when it is created (`admit`, as a validating webhook refuses it: `kubectl apply`
and `olmo-ctl submit` print why), rather than started as dozens of trainer processes that exhaust the
machine's memory: the stage-1 tpu7x-128 JobSet would be 16 processes of a 7B model.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from olmo_ctl.core.batching import STATE_BYTES_PER_PARAM, param_count
from olmo_ctl.core.contracts import (
    COORDINATOR_ENV,
    GPU_COORDINATOR_ADDRESS_ENV,
    GPU_COORDINATOR_PORT_ENV,
    LOG_PREFIX_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
)
from olmo_ctl.core.devices import GENERATIONS
from olmo_ctl.ports import free_port
from olmo_ctl.sandbox.cluster.objects import (
    COMPLETION_INDEX,
    JOB_INDEX_LABEL,
    JOBSET_NAME_LABEL,
    RESTARTS_LABEL,
    deleting,
    labels,
    pod_requests,
    pod_terminal,
    sidecars,
)
from olmo_ctl.sandbox.sandbox import PodRunner

if TYPE_CHECKING:
    from olmo_ctl.sandbox.sandbox import SandboxWorld

TPU = "google.com/tpu"
GPU = "nvidia.com/gpu"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
GENERATION_LABEL = "cloud.google.com/machine-family"
CLUSTER_DOMAIN = "svc.cluster.local"  # the kubelet's --cluster-domain, after the namespace
START_ERROR_EXIT = 128
MAX_LOG_LINES = 20000  # per pod: older lines are dropped, as a node rotates container logs
_DROPPED_ENV = (PROCESS_ID_ENV, NUM_PROCESSES_ENV, LOG_PREFIX_ENV, COORDINATOR_ENV, "KUBECONFIG")
GIB = 1024**3
PROCESS_BYTES = GIB  # a trainer process before its model: Python, JAX, XLA's CPU client
WEBHOOK = "pods-as-processes.sandbox.olmo-ctl"


def exit_code_of(returncode: int) -> int:
    """Popen's returncode (-N for signal N) as a container runtime reports it (128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def node_devices(node: dict | None) -> int | None:
    """JAX devices of one VM of this node: its google.com/tpu chips x the generation's devices per chip,
    or its nvidia.com/gpu GPUs (one device each)."""
    if node is None:
        return None
    lab = labels(node)
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    if allocatable.get(TPU) is None and allocatable.get(GPU) is not None:
        return int(float(allocatable[GPU]))
    chips = allocatable.get(TPU)
    gen = GENERATIONS.get(lab.get(GENERATION_LABEL, "")) or next(
        (g for g in GENERATIONS.values() if g.accelerator_label == lab.get(ACCELERATOR_LABEL)), None
    )
    if chips is None:
        return None
    return int(float(chips)) * (gen.devices_per_chip if gen else 1)


def expand(value: str, mapping: dict[str, str]) -> str:
    """The kubelet's expansion of a container's env value (third_party/forked/golang/expansion):
    `$(NAME)` becomes NAME's value where NAME is defined before it, else stays as written; `$$` is `$`."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("$(", i) and ")" in value[i + 2 :]:
            end = value.index(")", i + 2)
            name = value[i + 2 : end]
            out.append(mapping[name] if name in mapping else value[i : end + 1])
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def pod_by_dns_name(world: SandboxWorld, namespace: str, host: str) -> dict | None:
    """The live pod the cluster's DNS resolves `host` to: `<hostname>.<subdomain>` (optionally
    `.<namespace>[.svc[.cluster.local]]`), a pod with that hostname and subdomain; None for any other
    name."""
    parts = host.strip().rstrip(".").split(".")
    if len(parts) < 2 or ".".join(parts[3:]) not in ("", "svc", CLUSTER_DOMAIN):
        return None
    ns = parts[2] if len(parts) > 2 else namespace
    for p in world.items("Pod", ns):
        spec = p["spec"]
        if (spec.get("hostname"), spec.get("subdomain")) == (parts[0], parts[1]) and not (
            pod_terminal(p) or deleting(p)
        ):
            return p
    return None


def _field_ref(pod: dict, path: str) -> str:
    md = pod["metadata"]
    simple = {
        "metadata.name": md.get("name"),
        "metadata.namespace": md.get("namespace"),
        "metadata.uid": md.get("uid"),
        "spec.nodeName": pod["spec"].get("nodeName"),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName"),
        "status.podIP": pod["status"].get("podIP"),
        "status.hostIP": pod["status"].get("hostIP"),
    }
    if path in simple:
        return str(simple[path] or "")
    for prefix, src in (
        ("metadata.labels", md.get("labels")),
        ("metadata.annotations", md.get("annotations")),
    ):
        if path.startswith(prefix + "['") and path.endswith("']"):
            return str((src or {}).get(path[len(prefix) + 2 : -2], ""))
    return ""


def machine_memory_bytes() -> int:
    """This machine's physical memory."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 0


def _trainer_recipe(jobset: dict):
    """The recipe an olmo-ctl JobSet trains: its run's run.yaml where that can be read without a network
    probe (a local run directory, or gs:// with a GCS emulator set), else the shipped recipe its
    annotation names; None for another program's JobSet or a recipe that cannot be found."""
    from olmo_ctl.backends.jobset import ANNOTATION_RECIPE, ANNOTATION_RUN_DIR
    from olmo_ctl.core.errors import OlmoCtlError
    from olmo_ctl.core.recipe import load_recipe, shipped_recipes

    ann = (jobset.get("metadata") or {}).get("annotations") or {}
    name, run_dir = ann.get(ANNOTATION_RECIPE), ann.get(ANNOTATION_RUN_DIR)
    if not name:
        return None
    if run_dir and (os.environ.get("STORAGE_EMULATOR_HOST") or not run_dir.startswith("gs://")):
        from olmo_ctl.rundir import RunDir

        try:
            return RunDir(run_dir).recipe()
        except (OlmoCtlError, OSError, ValueError):
            pass  # not created yet (a `submit --dry-run` manifest applied by hand): the named recipe
    if name in shipped_recipes():
        try:
            return load_recipe(name)
        except OlmoCtlError:
            return None
    return None


@dataclass(frozen=True)
class TrainerNeed:
    """What an olmo-ctl JobSet's trainer processes need of one machine's memory, at least."""

    recipe: str
    model: str
    params: int
    processes: int
    state_bytes: int  # STATE_BYTES_PER_PARAM per parameter, one copy per slice
    activation_bytes: int  # one micro-batch (global batch / accumulation) of activations
    bytes: int  # the two, plus PROCESS_BYTES per process


def trainer_need(jobset: dict) -> TrainerNeed | None:
    """The memory the JobSet's trainers need together, at least (None for another program's JobSet):
    the training state (sharded over a slice's devices, one copy per slice), one micro-batch of
    activations (`olmo-ctl/plan`'s global batch / grad accumulation instances), PROCESS_BYTES each."""
    from olmo_ctl.backends.jobset import ANNOTATION_PLAN
    from olmo_ctl.core.batching import activation_bytes_per_instance

    recipe = _trainer_recipe(jobset)
    if recipe is None:
        return None
    jobs = (jobset.get("spec") or {}).get("replicatedJobs") or []
    slices = sum(int(j.get("replicas") or 1) for j in jobs) or 1
    processes = sum(
        int(j.get("replicas") or 1)
        * int(((j.get("template") or {}).get("spec") or {}).get("parallelism") or 1)
        for j in jobs
    )
    plan = dict(
        kv.split("=", 1)
        for kv in (
            ((jobset.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_PLAN) or ""
        ).split()
        if "=" in kv
    )
    try:
        instances = max(1, int(plan["global_batch"]) // max(1, int(plan.get("grad_accum", "1"))))
    except (KeyError, ValueError):
        instances = 1
    params = param_count(recipe.model)
    state = params * STATE_BYTES_PER_PARAM * slices
    acts = activation_bytes_per_instance(recipe.model, recipe.train.seq_len) * instances
    return TrainerNeed(
        recipe.name,
        recipe.model.name,
        params,
        processes,
        state,
        acts,
        state + acts + PROCESS_BYTES * processes,
    )


def refuse_unfit(jobset: dict, memory_bytes: int) -> str | None:
    """Why this JobSet's trainer processes cannot all run on a machine of `memory_bytes`, or None."""
    need = trainer_need(jobset)
    if need is None or memory_bytes <= 0 or need.bytes <= memory_bytes:
        return None
    name = (jobset.get("metadata") or {}).get("name")
    n = need.processes
    return (
        f"JobSet {name} trains {need.recipe} (model {need.model}, {need.params / 1e9:.1f} B parameters) as "
        f"{n} trainer process{'es' if n != 1 else ''} on this machine: they need at least "
        f"{need.bytes / GIB:,.0f} GiB (training state {need.state_bytes / GIB:,.0f} GiB, one micro-batch of "
        f"activations {need.activation_bytes / GIB:,.0f} GiB) and it has {memory_bytes / GIB:,.0f} GiB. "
        "The sandbox runs pods as local processes: use a model that fits (e.g. --recipe smoke), or start "
        "the sandbox with --no-run-pods to apply JobSets without running their pods"
    )


@dataclass
class PodProcess:
    """A pod's container as a local process."""

    uid: str
    namespace: str
    name: str
    popen: subprocess.Popen
    started: float
    sigterm_at: float | None = None
    exited_at: float | None = None
    shutdown_ends: float | None = None  # a node's graceful shutdown: SIGKILL then (the world's clock)
    killed: bool = False
    reported: bool = False
    reader: threading.Thread | None = field(default=None, repr=False)


class ProcessRunner(PodRunner):
    """The sandbox's kubelet for real processes (the scripted `sandbox.PodRunner` keeps pods Running
    without a program); every hook of `PodRunner` is its own. `attach` is called by `SandboxWorld`;
    `close` kills what is left."""

    def __init__(
        self,
        log: Callable[[str], None] | None = None,
        poll_s: float = 0.2,
        cwd: str | None = None,
        base_env: dict[str, str] | None = None,
        memory_bytes: int | None = None,
    ):
        self._say = log or (lambda line: None)
        self.memory_bytes = machine_memory_bytes() if memory_bytes is None else memory_bytes
        self.lines: list[str] = []  # what it said: starts, signals, exits
        self.poll_s = poll_s
        self.cwd = cwd
        self.base_env = base_env
        self.procs: dict[str, PodProcess] = {}  # pod uid -> its process
        self.ports: dict[tuple[str, str], int] = {}  # (JobSet uid, restart attempt) -> coordinator port
        self.world: SandboxWorld | None = None
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None

    def log(self, line: str) -> None:
        self.lines.append(line)
        self._say(line)

    # -- the seam
    def attach(self, world: SandboxWorld) -> None:
        self.world = world
        # A container exits when its process does: the world's kubelet never decides it, except that a
        # grace period's end is SIGKILL (137), which `sync` also delivers to the process.
        world.sigterm_exit_s = None
        self._loop = threading.Thread(target=self._run_loop, name="sandbox-kubelet", daemon=True)
        self._loop.start()

    def admit(self, world: SandboxWorld, jobset: dict) -> None:
        """A JobSet is created: refused (400, as a validating webhook's denial) when its trainer processes
        cannot fit in this machine's memory."""
        from olmo_ctl.sandbox.kube_api import ApiError

        why = refuse_unfit(jobset, self.memory_bytes)
        if why:
            self.log(f"refused {why}")
            raise ApiError(400, "BadRequest", f'admission webhook "{WEBHOOK}" denied the request: {why}')

    def start(self, world: SandboxWorld, pod: dict, node: str) -> None:
        world.start_pod(pod, node)
        md = pod["metadata"]
        container = (pod["spec"].get("containers") or [{}])[0]
        try:
            cmd, env, cwd = self.launch(world, pod, container)
            p = subprocess.Popen(
                cmd,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        except (OSError, ValueError) as e:
            msg = f"failed to start container {container.get('name')!r}: {e}"
            world.container_exit(pod, START_ERROR_EXIT, [msg], reason="StartError")
            self.log(f"pod {md['name']}: {msg}")
            return
        proc = PodProcess(md["uid"], md["namespace"], md["name"], p, time.monotonic())
        proc.reader = threading.Thread(target=self._read, args=(proc,), name=f"log-{md['name']}", daemon=True)
        self.procs[md["uid"]] = proc
        proc.reader.start()
        self.log(f"pod {md['name']} on {node}: pid {p.pid}: {shlex.join(cmd)}")
        for c in sidecars(pod["spec"]):
            world.store.logs[(md["namespace"], md["name"], c["name"])] = [
                f"olmo-ctl sandbox: sidecar {c['name']} ({c.get('image', '')}) runs no process on {node}: "
                "what it serves on a GPU node has no NICs to serve here, where the trainers join over gloo"
            ]

    def stop(self, world: SandboxWorld, pod: dict) -> None:
        """The pod is being deleted: SIGTERM to its container's main process."""
        proc = self.procs.get(pod["metadata"]["uid"])
        if proc is None or proc.sigterm_at is not None or proc.popen.poll() is not None:
            return
        proc.sigterm_at = time.monotonic()
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        pid = self.main_pid(proc)
        self.log(f"pod {proc.name}: SIGTERM to pid {pid} (grace period {grace} s)")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def shutdown(self, world: SandboxWorld, pod: dict) -> None:
        """Graceful node shutdown: SIGTERM to the container's process, no deletion, and SIGKILL once the
        shutdown's time for non-system pods is over (`SPOT_POD_SHUTDOWN_S`, as GKE's kubelet gives them
        on a spot VM)."""
        from olmo_ctl.sandbox.cluster.nodes import SPOT_POD_SHUTDOWN_S

        self.stop(world, pod)
        proc = self.procs.get(pod["metadata"]["uid"])
        if proc is not None and proc.shutdown_ends is None:
            proc.shutdown_ends = world.store.clock() + SPOT_POD_SHUTDOWN_S

    def kill(self, world: SandboxWorld, pod: dict) -> None:
        """The host went down: the process dies now; its exit is reported when the node is back."""
        proc = self.procs.get(pod["metadata"]["uid"])
        if proc is not None:
            self._kill(proc, "its host went down")

    def sync(self, world: SandboxWorld) -> bool:
        """One kubelet pass (inside the world's reconcile, under the store's lock): exits become the
        pods' state; a grace period's end, a lost node or a force delete SIGKILLs the process group."""
        changed = False
        now = world.store.clock()
        for uid, proc in list(self.procs.items()):
            pod = world.get("Pod", proc.namespace, proc.name)
            if pod is not None and pod["metadata"]["uid"] != uid:
                pod = None
            code = proc.popen.poll()
            if pod is not None and not pod_terminal(pod) and world.node_unreachable(pod):
                continue  # its kubelet neither hears of a deletion nor reports an exit until it is back
            if code is None and proc.shutdown_ends is not None and now >= proc.shutdown_ends:
                self._kill(proc, "the node's graceful shutdown ended")
                continue
            if code is None:
                if pod is None or pod_terminal(pod):
                    self._kill(
                        proc, "the pod is gone" if pod is None else "the pod ended without it: a lost node"
                    )
                elif deleting(pod):
                    if world.node_down(pod["spec"].get("nodeName")):
                        continue  # its kubelet is not there to stop it: it runs on, Terminating
                    if proc.sigterm_at is None:
                        self.stop(world, pod)
                    ts = pod["metadata"].get("deletionTimestamp")
                    if ts and world.seconds_since(ts) >= 0:
                        self._kill(proc, "its grace period ended")
                continue
            if proc.exited_at is None:
                proc.exited_at = now
                # The container ends with its main process: whatever it left in its group goes too.
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if proc.reader is not None and proc.reader.is_alive() and now - proc.exited_at < 2.0:
                continue  # its last lines reach the log before the pod ends (a child may hold the pipe)
            if not proc.reported:
                proc.reported = True
                exit_code = self.exit_code(proc, code)
                if pod is not None and not pod_terminal(pod) and pod["spec"].get("nodeName"):
                    world.container_exit(pod, exit_code)
                    changed = True
                self.log(f"pod {proc.name}: pid {proc.popen.pid} exited {exit_code}")
            del self.procs[uid]
            self.ended(proc)
        return changed

    # -- the container (an image runtime changes these: pod_images.ImageRunner)
    def launch(self, world: SandboxWorld, pod: dict, container: dict) -> tuple[list[str], dict, str | None]:
        """The process that is the pod's container: its argv, environment and working directory."""
        env = self.environment(world, pod, container)
        return self.command(container), env, container.get("workingDir") or self.cwd

    def host_env(self) -> dict[str, str]:
        """What a pod's environment starts from: the sandbox's own (or `base_env`)."""
        return dict(os.environ if self.base_env is None else self.base_env)

    def main_pid(self, proc: PodProcess) -> int:
        """The container's main process, which a pod's deletion sends SIGTERM."""
        return proc.popen.pid

    def exit_code(self, proc: PodProcess, returncode: int) -> int:
        """The container's exit code, as a container runtime reports it."""
        return exit_code_of(returncode)

    def log_line(self, proc: PodProcess, line: str) -> str | None:
        """A line of the process's output as the pod's log has it (None: not the container's)."""
        return line

    def ended(self, proc: PodProcess) -> None:
        """The pod's process is gone and reported."""

    @staticmethod
    def command(container: dict) -> list[str]:
        argv = [str(a) for a in list(container.get("command") or []) + list(container.get("args") or [])]
        if not argv:
            raise ValueError("the container has no command (an image's entrypoint cannot run here)")
        exe = os.path.basename(argv[0])
        if exe in ("python", "python3") or (exe.startswith("python3") and "/" in argv[0]):
            argv[0] = sys.executable
        return argv

    def coordinator(self, pod: dict) -> str:
        lab = labels(pod)
        key = (
            lab.get("jobset.sigs.k8s.io/jobset-uid") or lab.get(JOBSET_NAME_LABEL) or pod["metadata"]["uid"],
            lab.get(RESTARTS_LABEL, "0"),
        )
        if key not in self.ports:
            self.ports[key] = free_port()
        return f"127.0.0.1:{self.ports[key]}"

    def environment(self, world: SandboxWorld, pod: dict, container: dict) -> dict[str, str]:
        env = self.host_env()
        for k in _DROPPED_ENV:
            env.pop(k, None)
        own: dict[str, str] = {}
        for e in container.get("env") or []:
            if "value" in e:
                own[e["name"]] = expand(str(e["value"]), own)
            elif ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath"):
                own[e["name"]] = _field_ref(pod, e["valueFrom"]["fieldRef"]["fieldPath"])
        env.update(self.webhook_env(world, pod, own))
        env.update(own)
        env.update(self.pod_network_env(world, pod, own))
        # The emulated TPU VM: the CPU platform with the VM's devices, whatever the manifest asks for.
        env["JAX_PLATFORMS"] = "cpu"
        devices = node_devices(world.get("Node", "", pod["spec"].get("nodeName") or ""))
        if devices:
            other = [
                f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
            ]
            env["XLA_FLAGS"] = " ".join(other + [f"--xla_force_host_platform_device_count={devices}"])
        env[COORDINATOR_ENV] = self.coordinator(pod)
        return env

    def pod_network_env(self, world: SandboxWorld, pod: dict, own: dict[str, str]) -> dict[str, str]:
        """A GPU pod's coordinator as this machine reaches it (module note): the DNS name of the pod it
        names -> 127.0.0.1, its port -> that pod's JobSet's coordinator port; {} otherwise."""
        host = own.get(GPU_COORDINATOR_ADDRESS_ENV, "")
        if not host or GPU_COORDINATOR_PORT_ENV not in own:
            return {}
        target = pod_by_dns_name(world, pod["metadata"]["namespace"], host)
        if target is None:
            return {}
        _, _, port = self.coordinator(target).rpartition(":")
        return {GPU_COORDINATOR_ADDRESS_ENV: "127.0.0.1", GPU_COORDINATOR_PORT_ENV: port}

    @staticmethod
    def webhook_env(world: SandboxWorld, pod: dict, own: dict[str, str]) -> dict[str, str]:
        """What GKE's TPU webhook adds to a pod of an Indexed Job that requests google.com/tpu."""
        md, spec = pod["metadata"], pod["spec"]
        lab, ann = labels(pod), md.get("annotations") or {}
        index = ann.get(COMPLETION_INDEX, lab.get(COMPLETION_INDEX))
        job_name = lab.get("batch.kubernetes.io/job-name") or lab.get("job-name")
        if index is None or not job_name or not pod_requests({"spec": spec}).get(TPU):
            return {}
        job = world.get("Job", md["namespace"], job_name)
        count = int(((job or {}).get("spec") or {}).get("parallelism") or 1)
        sub = spec.get("subdomain")
        hosts = [f"{job_name}-{i}" + (f".{sub}" if sub else "") for i in range(count)]
        env = {"TPU_WORKER_ID": str(index), "TPU_WORKER_HOSTNAMES": ",".join(hosts)}
        slices = int(lab.get("jobset.sigs.k8s.io/replicatedjob-replicas", "1") or 1)
        if slices > 1:
            js, rjob = lab.get(JOBSET_NAME_LABEL, ""), lab.get("jobset.sigs.k8s.io/replicatedjob-name", "")
            multi = {
                "MEGASCALE_NUM_SLICES": str(slices),
                "MEGASCALE_SLICE_ID": lab.get(JOB_INDEX_LABEL, "0"),
                "MEGASCALE_COORDINATOR_ADDRESS": f"{js}-{rjob}-0-0" + (f".{sub}" if sub else ""),
            }
            env.update({k: v for k, v in multi.items() if k not in own})
        return env

    # -- the process
    def _read(self, proc: PodProcess) -> None:
        world, stdout = self.world, proc.popen.stdout
        assert world is not None and stdout is not None  # `start` runs on an attached runner, stdout piped
        store = world.store
        key = (proc.namespace, proc.name)
        for raw in iter(stdout.readline, b""):
            line = self.log_line(proc, raw.decode("utf-8", "replace").rstrip("\n"))
            if line is None:
                continue
            with store.lock:
                pod = world.get("Pod", proc.namespace, proc.name)
                if pod is None or pod["metadata"]["uid"] != proc.uid:
                    continue
                lines = store.logs.setdefault(key, [])
                lines.append(line)
                if len(lines) > MAX_LOG_LINES:
                    del lines[: len(lines) - MAX_LOG_LINES]
        stdout.close()

    def _kill(self, proc: PodProcess, why: str) -> None:
        if proc.killed:
            return
        proc.killed = True
        self.log(f"pod {proc.name}: SIGKILL to pid {proc.popen.pid} ({why})")
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _run_loop(self) -> None:
        """Between API requests the kubelet still notices exits and grace periods' ends."""
        while not self._stop.wait(self.poll_s):
            world = self.world
            if world is None:
                continue
            try:
                if self.procs:
                    with world.store.lock:
                        world.reconcile()
            except Exception as e:  # noqa: BLE001 - the loop must outlive one bad pass; say what it was
                self.log(f"kubelet pass failed: {type(e).__name__}: {e}")

    def pid(self, namespace: str, name: str) -> int | None:
        """The process of a pod (tests)."""
        for p in list(self.procs.values()):
            if (p.namespace, p.name) == (namespace, name):
                return p.popen.pid
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        """The sandbox stops: every process group still running is SIGKILLed and reaped."""
        self._stop.set()
        if self._loop is not None:
            self._loop.join(timeout_s)
        for proc in list(self.procs.values()):
            if proc.popen.poll() is None:
                self._kill(proc, "the sandbox stopped")
            try:
                proc.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
            if proc.reader is not None:
                proc.reader.join(1.0)
            self.ended(proc)
        self.procs.clear()
