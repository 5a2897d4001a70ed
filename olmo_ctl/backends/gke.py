"""The GKE backend: an attempt is one JobSet, queued by Kueue, on a TPU slice (or N) or on N GPU nodes.

`render` is pure (the JobSet from `olmo_ctl.backends.jobset.render_jobset`, what --dry-run prints).
`send` creates it with strict field validation; a 409 on the same name means an earlier try of
this very submit went through (a lost response, a restarted supervisor), so the JobSet is adopted
when its labels say it is this attempt, and refused otherwise. `status` reads the JobSet, the Kueue
Workload it owns (found by ownerReference uid, never by name), its pods and their events, and hands
them to `olmo_ctl.backends.gke_status.classify`; for a failure it adds the failed pod's last log lines. `stop`
deletes with propagationPolicy Foreground and a uid precondition, so only this attempt's object
goes. Every call goes through `kube.call` (retries on connection errors, 429 and 5xx; never on
other 4xx; `Unreachable` after the budget: nothing is deleted or created on the way out).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from olmo_ctl.backends.apis import (
    JOBSET_GROUP,
    JOBSET_VERSION,
    JOBSETS,
    KUEUE_GROUP,
    KUEUE_VERSIONS,
    WORKLOAD_PRIORITY_CLASSES,
    WORKLOADS,
)
from olmo_ctl.backends.base import Attempt, AttemptStatus, Backend, Handle, SmokeProfile, State, Target
from olmo_ctl.backends.gke_options import GKEOptions
from olmo_ctl.backends.jobset import identity_note, placement_policy_for, render_jobset
from olmo_ctl.backends.kube import (
    DEFAULT_POLICY,
    KubeRetryPolicy,
    api_status,
    call,
    make_api_client,
    status_message,
)
from olmo_ctl.core.errors import BadInput

if TYPE_CHECKING:
    from olmo_ctl.core.config import Settings

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
RUN_LABEL = "olmo-ctl/run"
ATTEMPT_LABEL = "olmo-ctl/attempt"
RUN_DIR_ANNOTATION = "olmo-ctl/run-dir"
LOG_TAIL = 50
MAX_POD_EVENT_READS = 4  # per status: the events of at most this many problem pods


def _labels(obj: dict) -> dict:
    return (obj.get("metadata") or {}).get("labels") or {}


def _annotations(obj: dict) -> dict:
    return (obj.get("metadata") or {}).get("annotations") or {}


def _same_run_dir(jobset: dict, run_dir: str) -> bool:
    """Whether a JobSet belongs to the run in `run_dir`: its `olmo-ctl/run-dir` annotation names it
    (a JobSet without the annotation is taken as this run's: nothing says otherwise)."""
    theirs = _annotations(jobset).get(RUN_DIR_ANNOTATION)
    return theirs is None or theirs.rstrip("/") == run_dir.rstrip("/")


def _json(resp: Any) -> Any:
    return json.loads(resp.data or b"null")


class GKEBackend(Backend[dict]):
    """Backend over the Kubernetes API. Tests pass `host` (the test server's URL) and `namespace`;
    otherwise the kubeconfig's `context` (or its current one) or the in-cluster account is used."""

    name = "gke"
    smoke = SmokeProfile(max_steps=2000, poll_s=2.0)
    needs_real = ("run_root", "image")
    options = GKEOptions

    def __init__(
        self,
        namespace: str | None = None,
        host: str | None = None,
        context: str | None = None,
        settings: Settings | None = None,
        retry: KubeRetryPolicy | None = None,
        api_client: Any = None,
        kubeconfig: str | None = None,
    ):
        self.settings = settings
        self.namespace = namespace or (settings.namespace if settings else None) or "default"
        self.host = host
        self.context = context or (settings.kube_context if settings else None)
        self.kubeconfig = kubeconfig
        self.retry = retry or DEFAULT_POLICY
        self._api_client = api_client
        self._kueue_version: str | None = None  # resolved on first use; "" = no Kueue API

    @classmethod
    def from_settings(cls, settings: Settings, run_root: str | None = None) -> GKEBackend:
        return cls(settings=settings)

    @classmethod
    def for_status(cls, handle: Handle, run_dir: str) -> GKEBackend:
        quick = KubeRetryPolicy(budget_s=20.0, max_attempts=4, connect_timeout_s=5.0, read_timeout_s=15.0)
        return cls(namespace=handle.data.get("namespace"), context=handle.data.get("context"), retry=quick)

    # ------------------------------------------------------------------ before anything is written
    def _settings(self, attempt: Attempt) -> Settings:
        settings = self.settings_of(attempt)
        if settings is None:
            raise BadInput(
                "the GKE backend needs site settings to render a JobSet", "see `olmo-ctl config show`"
            )
        return settings

    def validate_target(
        self, target: Target, settings: Settings | None, run_dir: str, *, render_only: bool = False
    ) -> None:
        """A TPU slice or GPU nodes, no placeholder settings (unless only rendering) and a run directory
        on GCS (the pods cannot see this machine's files)."""
        dev = target.device
        if not dev.is_tpu and not dev.is_gpu_nodes:
            raise BadInput(
                f"`{dev.name}` is a local device; the GKE backend runs on TPU slices and GPU nodes",
                "for a local run add --backend local (cpu-N and gpu-N devices run on this machine), "
                "or use a TPU device such as tpu7x-128",
            )
        settings = settings or self.settings
        if settings is None:
            raise BadInput(
                "the GKE backend needs site settings to render a JobSet", "see `olmo-ctl config show`"
            )
        if not render_only and self.placeholders(settings):
            raise BadInput(
                f"site settings still hold placeholders ({', '.join(self.placeholders(settings))})",
                "see `olmo-ctl config show`; --dry-run works without them",
            )
        if not run_dir.startswith("gs://"):
            raise BadInput(
                f"run root `{run_dir.rsplit('/', 1)[0]}` is not on GCS; {'GPU' if dev.is_gpu_nodes else 'TPU'} "
                "pods cannot see this machine's files",
                "set the run root to gs://BUCKET/PREFIX (--run-root, OLMO_CTL_RUN_ROOT or run_root "
                "in the config file)",
            )

    def checks(self, attempt: Attempt) -> None:
        """The queue, the priority class and a flavor for the slice that Kueue needs (exit 2 naming the
        missing object), before anything is created."""
        from olmo_ctl.backends.doctor import submit_checks

        submit_checks(self.api_client, self._settings(attempt), attempt.target.device, attempt.slices)
        self._check_run_name(attempt)

    def _check_run_name(self, attempt: Attempt) -> None:
        """JobSet names are `<run>-a<attempt>`: a run of the same name from another run directory in
        this namespace would share them, and its attempts would look like ours. Refused before
        anything is written, naming the other run."""
        ns = self._settings(attempt).namespace or self.namespace
        for js in self._run_jobsets(attempt.run, ns):
            if not _same_run_dir(js, attempt.run_dir):
                raise BadInput(
                    f"namespace `{ns}` already holds run `{attempt.run}` of another run directory "
                    f"({_annotations(js).get(RUN_DIR_ANNOTATION)}; JobSet {js['metadata']['name']})",
                    "choose another --run name or --namespace, or delete that run's JobSets "
                    f"(`kubectl delete jobset -n {ns} -l {RUN_LABEL}={attempt.run}`)",
                )

    def notes(self, attempt: Attempt, *, render_only: bool = False) -> list[str]:
        settings = self._settings(attempt)
        out = []
        ident = identity_note(settings, attempt.target.device)
        if ident:
            out.append(ident)
        if render_only:
            for name in self.placeholders(settings):
                out.append(
                    f"`{name}` is the placeholder `{getattr(settings, name)}`; set --{name.replace('_', '-')}, "
                    f"OLMO_CTL_{name.upper()} or `{name}:` in the config file (see `olmo-ctl config show`)"
                )
            dev = attempt.target.device
            if settings.placement_policy and placement_policy_for(dev, settings) is None:
                out.append(
                    f"placement policy `{settings.placement_policy}` is not used: {dev.name} node pools "
                    "carry none"
                )
        return out

    # ------------------------------------------------------------------ plumbing
    @property
    def api_client(self):
        if self._api_client is None:
            self._api_client = make_api_client(
                host=self.host, context=self.context, kubeconfig=self.kubeconfig
            )
        return self._api_client

    @property
    def _custom(self):
        from kubernetes import client

        return client.CustomObjectsApi(self.api_client)

    @property
    def _core(self):
        from kubernetes import client

        return client.CoreV1Api(self.api_client)

    @property
    def _batch(self):
        from kubernetes import client

        return client.BatchV1Api(self.api_client)

    def _call(self, what: str, fn, *args, **kwargs):
        kwargs.setdefault("_request_timeout", self.retry.request_timeout)
        where = self.host or (self.api_client.configuration.host if self._api_client is not None else "")
        return call(fn, *args, policy=self.retry, what=what, host=where, **kwargs)

    def _get_jobset(self, name: str, ns: str) -> dict | None:
        try:
            return _json(
                self._call(
                    f"read JobSet {name}",
                    self._custom.get_namespaced_custom_object,
                    JOBSET_GROUP,
                    JOBSET_VERSION,
                    ns,
                    JOBSETS,
                    name,
                    _preload_content=False,
                )
            )
        except Exception as e:
            if api_status(e) == 404:
                return None
            raise self._api_error(e, f"read JobSet {name}") from e

    def _api_error(self, e: Exception, what: str) -> Exception:
        """Turn a non-retryable API answer into a one-line error; anything else propagates as is."""
        status = api_status(e)
        if not status:
            return e
        msg = status_message(e)
        if status == 401:
            return BadInput(
                f"{what}: the Kubernetes API refused our credentials ({msg})",
                "refresh them: gcloud container clusters get-credentials CLUSTER --region REGION",
            )
        if status == 403:
            return BadInput(
                f"{what}: forbidden: {msg}",
                f"the account needs access to jobsets, workloads, pods and events in `{self.namespace}`",
            )
        return BadInput(f"{what}: HTTP {status}: {msg}")

    # ------------------------------------------------------------------ render
    def render(self, attempt: Attempt) -> dict:
        """The JobSet for this attempt: pure, from the resolved recipe and plan the attempt carries."""
        settings = self._settings(attempt)
        return render_jobset(
            attempt.recipe,
            attempt.plan,
            attempt.target.device,
            settings,
            attempt.run,
            attempt.attempt,
            attempt.run_dir,
            attempt.slices,
            extra_args=attempt.extra_args,
            extra_env=attempt.env,
        )

    # ------------------------------------------------------------------ submit
    def send(self, request: dict) -> Handle:
        md = request.get("metadata") or {}
        name = md.get("name")
        if not name:
            raise BadInput("the JobSet has no metadata.name")
        ns = md.get("namespace") or self.namespace
        what = f"create JobSet {name} in {ns}"
        try:
            obj = self._create(what, request, ns)
        except Exception as e:
            status = api_status(e)
            if status == 409:
                obj = self._adopt(request, ns)
            elif status in (400, 422):
                raise BadInput(
                    f"the cluster rejected JobSet {name}: {status_message(e)}",
                    "is JobSet v0.10.1 or later installed? `kubectl get crd jobsets.jobset.x-k8s.io`; "
                    "`submit --dry-run` shows the manifest",
                ) from None
            elif status == 404:
                raise BadInput(
                    f"{what}: {status_message(e) or 'not found'}",
                    "check the namespace exists and JobSet is installed "
                    "(`kubectl api-resources | grep jobset`)",
                ) from None
            else:
                raise self._api_error(e, what) from e
        return self._handle(obj)

    def _create(self, what: str, request: dict, ns: str) -> dict:
        """Create the JobSet, unknown fields refused (strict field validation)."""
        return _json(
            self._call(
                what,
                self._custom.create_namespaced_custom_object,
                JOBSET_GROUP,
                JOBSET_VERSION,
                ns,
                JOBSETS,
                request,
                field_validation="Strict",
                _preload_content=False,
            )
        )

    def _adopt(self, request: dict, ns: str) -> dict:
        """A JobSet with this name exists: adopt it when it is this attempt, refuse otherwise."""
        name = request["metadata"]["name"]
        existing = self._get_jobset(name, ns)
        if existing is None:  # deleted in between: create again, once
            return self._create(f"create JobSet {name}", request, ns)
        # Same labels (run, attempt, device, ...) and the same run directory: the same attempt.
        # Two run roots may hold runs of the same name; the run directory tells them apart.
        want = {
            **_labels(request),
            **{f"annotation {k}": v for k, v in _annotations(request).items() if k == RUN_DIR_ANNOTATION},
        }
        have = {
            **_labels(existing),
            **{f"annotation {k}": v for k, v in _annotations(existing).items() if k == RUN_DIR_ANNOTATION},
        }
        mismatch = {k: (v, have.get(k)) for k, v in want.items() if have.get(k) != v}
        if mismatch:
            diff = ", ".join(f"{k}={b!r}, want {a!r}" for k, (a, b) in mismatch.items())
            raise BadInput(
                f"a JobSet named `{name}` already exists in `{ns}` and is not this attempt ({diff})",
                f"delete it (`kubectl delete jobset {name} -n {ns}`) or use another --run name",
            )
        if (existing.get("metadata") or {}).get("deletionTimestamp"):
            raise BadInput(
                f"JobSet `{name}` in `{ns}` is being deleted; it cannot be adopted",
                "wait until it is gone (`kubectl get jobset -n NS`), then submit again",
            )
        return existing

    def _handle(self, obj: dict) -> Handle:
        md = obj["metadata"]
        labels = md.get("labels") or {}
        try:
            attempt = int(labels.get(ATTEMPT_LABEL, 0))
        except ValueError:
            attempt = 0
        data = {
            "namespace": md.get("namespace") or self.namespace,
            "uid": md.get("uid"),
            "run": labels.get(RUN_LABEL),
        }
        if self.context:  # so that `monitor` asks the same cluster: GKEBackend(context=data["context"])
            data["context"] = self.context
        return Handle(self.name, md["name"], attempt, data)

    # ------------------------------------------------------------------ status
    def _ns(self, handle: Handle) -> str:
        return handle.data.get("namespace") or self.namespace

    def read_objects(self, handle: Handle) -> tuple[dict | None, dict | None, list[dict], list[dict]]:
        """JobSet, its Workload, its pods and the relevant events, as the API returns them."""
        ns = self._ns(handle)
        js = self._get_jobset(handle.name, ns)
        if js is None:
            return None, None, [], []
        uid = js["metadata"].get("uid")
        if handle.data.get("uid") and uid != handle.data["uid"]:
            return None, None, [], []  # the name now belongs to another object: ours is gone
        wl = self._find_workload(ns, uid, queued=QUEUE_LABEL in _labels(js))
        pods = self._list_pods(ns, handle.name)
        events = self._events(ns, js, wl, pods)
        return js, wl, pods, events

    def status(self, handle: Handle) -> AttemptStatus:
        from dataclasses import replace

        # loads with the first status, not for a render
        from olmo_ctl.backends.gke_status import child_jobs, classify, counted_job_failures

        js, wl, pods, events = self.read_objects(handle)
        missing = self._missing_for_workload(js) if js is not None and wl is None else ()
        st = classify(js, wl, pods, events, missing=missing)
        if js is not None and child_jobs(js) > 1:
            # Several child Jobs: a crashed one may fail after another's lost peer, uncounted by JobSet.
            crashes = counted_job_failures(
                js, self._children("Jobs", self._ns(handle), handle.name, True) or []
            )
            if crashes:
                limit = ((js.get("spec") or {}).get("failurePolicy") or {}).get("maxRestarts")
                st = replace(st, crashes=crashes, details={**st.details, "max_restarts": limit})
        if (
            st.state in (State.FAILED_USER, State.FAILED_INFRA, State.PREEMPTED)
            and st.details.get("pod")
            and st.exit_code is not None
        ):
            lines = self._pod_log(self._ns(handle), st.details["pod"], st.details.get("container"), LOG_TAIL)
            if lines:
                st = classify(js, wl, pods, events, logs={st.details["pod"]: lines}, missing=missing)
        return st

    def _missing_for_workload(self, js: dict) -> tuple[str, ...]:
        """Why Kueue builds no Workload for a queued, suspended JobSet: upstream (kueue v0.17.1
        jobframework/reconciler.go ExtractPriority) fails the reconcile on a missing
        WorkloadPriorityClass and only logs it, so we look the class up ourselves."""
        name = _labels(js).get(PRIORITY_LABEL)
        if not name or QUEUE_LABEL not in _labels(js) or not (js.get("spec") or {}).get("suspend"):
            return ()
        if self._kueue_version == "":
            return ()
        versions = (self._kueue_version,) if self._kueue_version else KUEUE_VERSIONS
        for version in versions:
            try:
                self._call(
                    f"read WorkloadPriorityClass {name}",
                    self._custom.get_cluster_custom_object,
                    KUEUE_GROUP,
                    version,
                    WORKLOAD_PRIORITY_CLASSES,
                    name,
                    _preload_content=False,
                )
                return ()
            except Exception as e:
                status = api_status(e)
                if (
                    status == 404
                    and "workloadpriorityclasses" in status_message(e).lower()
                    and "not found" in status_message(e).lower()
                ):
                    return (f'WorkloadPriorityClass "{name}" does not exist (label {PRIORITY_LABEL})',)
                if status == 404:
                    continue  # this Kueue version is not served
                if status == 403:
                    return ()  # cannot tell; the JobSet's own status must do
                raise self._api_error(e, f"read WorkloadPriorityClass {name}") from e
        return ()

    def _find_workload(self, ns: str, uid: str, queued: bool = True) -> dict | None:
        """The Workload whose controller ownerReference is this JobSet's uid. Kueue labels it with
        the job's uid; only for a queued JobSet is the whole namespace searched when that finds none
        (Workloads written by Kueue versions without the label)."""
        if self._kueue_version == "":
            return None
        versions = (self._kueue_version,) if self._kueue_version else KUEUE_VERSIONS
        selectors = (f"{KUEUE_JOB_UID_LABEL}={uid}", None) if queued else (f"{KUEUE_JOB_UID_LABEL}={uid}",)
        for version in versions:
            for selector in selectors:
                try:
                    data = _json(
                        self._call(
                            "list Kueue Workloads",
                            self._custom.list_namespaced_custom_object,
                            KUEUE_GROUP,
                            version,
                            ns,
                            WORKLOADS,
                            label_selector=selector,
                            _preload_content=False,
                        )
                    )
                except Exception as e:
                    if api_status(e) == 404:
                        break  # this version is not served: try the next one
                    if api_status(e) == 403:
                        return None  # no read access to Workloads: the JobSet's own status must do
                    raise self._api_error(e, "list Kueue Workloads") from e
                self._kueue_version = version
                owned = [
                    w
                    for w in data.get("items") or []
                    if any(
                        r.get("uid") == uid and r.get("controller")
                        for r in (w.get("metadata") or {}).get("ownerReferences") or []
                    )
                ]
                if owned:
                    return max(owned, key=lambda w: w["metadata"].get("creationTimestamp") or "")
                # Kueue versions before the job-uid label: look through the namespace once more.
            if self._kueue_version:
                return None
        self._kueue_version = ""  # no Kueue API on this cluster
        return None

    def _items(self, what: str, fn, ns: str, **selector) -> list[dict]:
        """The items of one list call (`label_selector=` or `field_selector=`), decoded."""
        return _json(self._call(what, fn, ns, _preload_content=False, **selector)).get("items") or []

    def _children(self, kind: str, ns: str, name: str, optional: bool = False) -> list[dict] | None:
        """The JobSet's `pods` or `Jobs` (those being deleted too); None for an optional read the
        account may not make (403, 404)."""
        fn = self._core.list_namespaced_pod if kind == "pods" else self._batch.list_namespaced_job
        what = f"list {kind} of {name}"
        try:
            return self._items(what, fn, ns, label_selector=f"{JOBSET_NAME_LABEL}={name}")
        except Exception as e:
            if optional and api_status(e) in (403, 404):
                return None
            raise self._api_error(e, what) from e

    def _list_pods(self, ns: str, name: str) -> list[dict]:
        return self._children("pods", ns, name) or []

    def _events(self, ns: str, js: dict, wl: dict | None, pods: list[dict]) -> list[dict]:
        targets = [js["metadata"]["name"]] + ([wl["metadata"]["name"]] if wl else [])
        # Pods that are not plainly running: pending, failed, not ready (a NotReady node marks them so),
        # or terminating (taint eviction): their events say why (FailedScheduling, NodeNotReady, ...).
        problem = [
            p
            for p in pods
            if (p.get("status") or {}).get("phase") in ("Pending", "Failed", "Unknown")
            or (p.get("metadata") or {}).get("deletionTimestamp")
            or any(
                c.get("type") == "Ready" and c.get("status") == "False"
                for c in (p.get("status") or {}).get("conditions") or []
            )
        ]
        targets += [p["metadata"]["name"] for p in problem[:MAX_POD_EVENT_READS]]
        out: list[dict] = []
        from olmo_ctl.backends.gke_status import expected_pods

        if not (js.get("spec") or {}).get("suspend") and len(pods) < expected_pods(js):
            out += self._failed_creates(ns, js)
        restarted = int((js.get("status") or {}).get("restarts") or 0) > 0
        if restarted and any((p.get("status") or {}).get("phase") == "Pending" for p in pods):
            out += self._kubelet_decisions(ns, js)
        for target in targets:
            try:
                out += self._items(
                    f"list events of {target}",
                    self._core.list_namespaced_event,
                    ns,
                    field_selector=f"involvedObject.name={target}",
                )
            except Exception as e:
                if api_status(e) in (403, 404):  # events are a nicety: their absence must not hide the state
                    continue
                raise self._api_error(e, f"list events of {target}") from e
        return out

    def _kubelet_decisions(self, ns: str, js: dict) -> list[dict]:
        """The kubelets' refusals (`UnexpectedAdmissionError`) and container starts about any pod of this
        JobSet, also of pods already gone: a refused pod is deleted by the restart it causes, and its
        event is the one record of why the new pods wait (gke_status._current_rejection)."""
        prefix = f"{js['metadata']['name']}-"
        out: list[dict] = []
        for reason in ("UnexpectedAdmissionError", "Started"):
            try:
                events = self._items(
                    f"list {reason} events",
                    self._core.list_namespaced_event,
                    ns,
                    field_selector=f"involvedObject.kind=Pod,reason={reason}",
                )
            except Exception as e:
                if api_status(e) in (400, 403, 404):  # events are a nicety
                    return []
                raise self._api_error(e, f"list {reason} events") from e
            out += [
                e for e in events if str((e.get("involvedObject") or {}).get("name") or "").startswith(prefix)
            ]
        return out

    def _failed_creates(self, ns: str, js: dict) -> list[dict]:
        """The FailedCreate events of this JobSet's Jobs (`<jobset>-<replicated job>-<index>`): the
        Job controller's record of pods the API server refused (Pod Security, a ResourceQuota)."""
        name = js["metadata"]["name"]
        jobs = {
            f"{name}-{rj.get('name')}-{i}"
            for rj in (js.get("spec") or {}).get("replicatedJobs") or []
            for i in range(int(rj.get("replicas", 1)))
        }
        try:
            events = self._items(
                "list FailedCreate events",
                self._core.list_namespaced_event,
                ns,
                field_selector="involvedObject.kind=Job,reason=FailedCreate",
            )
        except Exception as e:
            if api_status(e) in (400, 403, 404):  # events are a nicety: their absence must not hide the state
                return []
            raise self._api_error(e, "list FailedCreate events") from e
        mine = [e for e in events if (e.get("involvedObject") or {}).get("name") in jobs]
        if not mine:
            return []
        from olmo_ctl.backends.gke_status import current_failed_creates

        # A restart recreates the Jobs under the same names: only events about the Jobs of now count.
        now = self._children("Jobs", ns, name, optional=True)
        if now is None:  # cannot tell the restarts apart: the names must do
            return mine
        return [dict(e) for e in current_failed_creates(mine, now)]

    def _pod_log(self, ns: str, pod: str, container: str | None, tail: int | None) -> list[str]:
        try:
            resp = self._call(
                f"read the log of pod {pod}",
                self._core.read_namespaced_pod_log,
                pod,
                ns,
                container=container,
                tail_lines=tail,
                _preload_content=False,
            )
        except Exception as e:
            if api_status(e) in (400, 404):  # not started yet, or gone
                return []
            raise self._api_error(e, f"read the log of pod {pod}") from e
        text = (resp.data or b"").decode("utf-8", "replace")
        if tail is None:  # the whole log
            return text.splitlines()
        return text.splitlines()[-tail:] if tail else []

    # ------------------------------------------------------------------ stop / logs / find_live
    def stop(self, handle: Handle, graceful: bool = True) -> None:
        """Delete the JobSet (Foreground: its Workload and pods go first). Pods get SIGTERM and their
        grace period to checkpoint; `graceful=False` also deletes the pods at once (grace 0)."""
        ns = self._ns(handle)
        # Trust nothing read back: the handle (from the journal, perhaps) must name this run's attempt
        # on the cluster, and the delete carries the uid it was checked against.
        uid = self._verified_uid(handle, ns)
        if uid is None:
            return  # gone, or that name is another object now: leave it
        body: dict = {"propagationPolicy": "Foreground", "preconditions": {"uid": uid}}
        try:
            self._call(
                f"delete JobSet {handle.name}",
                self._custom.delete_namespaced_custom_object,
                JOBSET_GROUP,
                JOBSET_VERSION,
                ns,
                JOBSETS,
                handle.name,
                propagation_policy="Foreground",
                body=body,
                _preload_content=False,
            )
        except Exception as e:
            status = api_status(e)
            if status == 404:
                pass  # already gone
            elif status == 409:
                return  # the uid precondition failed: that name is another object now; leave it
            else:
                raise self._api_error(e, f"delete JobSet {handle.name}") from e
        if not graceful:
            try:
                self._call(
                    f"delete pods of {handle.name}",
                    self._core.delete_collection_namespaced_pod,
                    ns,
                    label_selector=f"{JOBSET_NAME_LABEL}={handle.name}",
                    grace_period_seconds=0,
                    _preload_content=False,
                )
            except Exception as e:
                if api_status(e) != 404:
                    raise self._api_error(e, f"delete pods of {handle.name}") from e

    def _verified_uid(self, handle: Handle, ns: str) -> str | None:
        """The uid of the JobSet `handle` names, once its labels say it is attempt `handle.attempt` of
        `handle.data["run"]`; None when it is gone or is another object than the handle's (uid); a
        JobSet of that name that belongs to another run or attempt is refused (exit 2), never deleted."""
        js = self._get_jobset(handle.name, ns)
        if js is None:
            return None
        uid = js["metadata"].get("uid")
        if handle.data.get("uid") and uid != handle.data["uid"]:
            return None
        labels = _labels(js)
        run = handle.data.get("run")
        if (run is not None and labels.get(RUN_LABEL) != run) or labels.get(ATTEMPT_LABEL) != str(
            handle.attempt
        ):
            raise BadInput(
                f"JobSet {ns}/{handle.name} is not attempt {handle.attempt} of run `{run}` (its labels say "
                f"run `{labels.get(RUN_LABEL)}`, attempt `{labels.get(ATTEMPT_LABEL)}`): not deleted",
                "check the run's journal and the JobSet; delete it by hand if it is yours",
            )
        return uid

    def wait_gone(self, handle: Handle, timeout_s: float = 600.0, poll_s: float = 2.0) -> bool:
        """Poll until the JobSet is gone; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            js = self._get_jobset(handle.name, self._ns(handle))
            if js is None or (handle.data.get("uid") and js["metadata"].get("uid") != handle.data["uid"]):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)

    def hint(self, status: AttemptStatus) -> str:
        """What to do about a queue set-up Kueue can never admit, an image no node can pull, pods the
        API server refuses, or a deactivated Workload, with the kubectl command that shows or fixes it."""
        text = status.config_error or ""
        if not text and status.deactivated:
            wl = status.workload or "WORKLOAD"
            return f'kubectl patch workload {wl} --type merge -p \'{{"spec":{{"active":true}}}}\''
        if not text:
            return "its pods' logs: olmo-ctl logs RUN --host N, or kubectl logs POD"
        if text.startswith("image "):
            return (
                "check that the image exists and that the nodes may pull it (`gcloud artifacts docker images "
                "describe IMAGE`; the node pool's service account needs Artifact Registry Reader), or set "
                "another with --image or `image:` in the site settings; then run the same command again"
            )
        if text.startswith("pods refused"):
            return (
                "the API server refuses the attempt's pods (the message names what: a ResourceQuota, Pod "
                "Security, an admission webhook); fix that, then run the same command again"
            )
        if "WorkloadPriorityClass" in text:
            return (
                "create it (`kubectl get workloadpriorityclasses`), or pick an existing one with --priority-class "
                "(an empty value for none); then run the same command again"
            )
        if ("LocalQueue" in text or "ClusterQueue" in text) and "doesn't exist" in text:
            return (
                "create the queue, or pick an existing one with --queue (`kubectl get localqueues -n NAMESPACE`); "
                "then run the same command again"
            )
        return (
            "the ClusterQueue has no ResourceFlavor with quota for this slice's accelerator and topology: ask the "
            "cluster admin to add one (`kubectl get clusterqueues -o yaml`), or use another --queue or --device"
        )

    def logs(self, handle: Handle, tail: int = LOG_TAIL) -> list[str]:
        """The last lines of the failed pod if one failed, else of worker 0 of slice 0."""
        return self._log_of(handle, None, tail)[1]

    def read_log(self, handle: Handle, host: int | None = None) -> tuple[str, list[str]]:
        """One pod's whole log: host `h` is the h-th pod in (slice, worker) order (the TPU VMs of
        slice 0, then of slice 1, ...); None: the failed pod if one failed, else host 0."""
        return self._log_of(handle, host, None)

    def _log_of(self, handle: Handle, host: int | None, tail: int | None) -> tuple[str, list[str]]:
        ns = self._ns(handle)
        pods = self._list_pods(ns, handle.name)
        if not pods:
            return "", []
        from olmo_ctl.backends.gke_status import container_exits

        def order(p):
            lab = _labels(p)
            return (int(lab.get(JOB_INDEX_LABEL, 0) or 0), int(lab.get(COMPLETION_INDEX_LABEL, 0) or 0))

        def container_of(pod: dict) -> str | None:
            containers = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
            return "trainer" if "trainer" in containers else (containers[0] if containers else None)

        if host is None:
            exits = container_exits(pods)
            if exits:
                return f"pod {exits[0].pod}", self._pod_log(ns, exits[0].pod, exits[0].container, tail)
            host = 0
        ordered = sorted(pods, key=order)
        if not 0 <= host < len(ordered):
            raise BadInput(
                f"attempt {handle.attempt} ({handle.name}) has {len(ordered)} pod(s) now (hosts "
                f"0..{len(ordered) - 1}), not host {host}",
                "pass a host in that range, or leave out --host",
            )
        pod = ordered[host]
        name = pod["metadata"]["name"]
        return f"pod {name}", self._pod_log(ns, name, container_of(pod), tail)

    def find_live(self, run: str, run_dir: str | None = None) -> Handle | None:
        """The newest attempt of `run` that is still live (queued, admitted or running), if any; with
        `run_dir`, only JobSets of that run directory (their `olmo-ctl/run-dir` annotation)."""
        live = self._live(run, first_only=True, run_dir=run_dir)
        return live[0] if live else None

    def live_attempts(self, run: str, run_dir: str | None = None) -> list[Handle]:
        """Every live attempt of `run`, newest first (one list call, a status per JobSet)."""
        return self._live(run, first_only=False, run_dir=run_dir)

    def _run_jobsets(self, run: str, ns: str | None = None) -> list[dict]:
        """Every JobSet labelled with this run name in the namespace (any run directory), not deleting."""
        ns = ns or self.namespace
        try:
            data = _json(
                self._call(
                    f"list JobSets of run {run}",
                    self._custom.list_namespaced_custom_object,
                    JOBSET_GROUP,
                    JOBSET_VERSION,
                    ns,
                    JOBSETS,
                    label_selector=f"{RUN_LABEL}={run}",
                    _preload_content=False,
                )
            )
        except Exception as e:
            raise self._api_error(e, f"list JobSets of run {run}") from e
        return [j for j in data.get("items") or [] if not j["metadata"].get("deletionTimestamp")]

    def _live(self, run: str, first_only: bool, run_dir: str | None = None) -> list[Handle]:
        candidates = [j for j in self._run_jobsets(run) if run_dir is None or _same_run_dir(j, run_dir)]

        def attempt_no(j):
            try:
                return int(_labels(j).get(ATTEMPT_LABEL, -1))
            except ValueError:
                return -1

        out = []
        for js in sorted(
            candidates,
            key=lambda j: (attempt_no(j), j["metadata"].get("creationTimestamp") or ""),
            reverse=True,
        ):
            handle = self._handle(js)
            if self.status(handle).state.live:
                out.append(handle)
                if first_only:
                    break
        return out
