"""Who may drive the sandbox's Kubernetes API: the holder of its kubeconfig's token, asking it by its own
address, with a body an API server decodes; and objects it cannot run are refused (4xx), never a
test-server bug (500). One in-process sandbox serves the module, as `olmo-ctl sandbox` serves
(`require_token=True`); raw HTTP shows exactly what a local user or a web page could send."""

from __future__ import annotations

import base64
import http.client
import json

import pytest

from olmo_ctl.sandbox.kube_api import BUILTIN
from olmo_ctl.sandbox.kube_server import tiny_jobset
from olmo_ctl.sandbox.sandbox import Sandbox
from olmo_ctl.sandbox.tls import client_context

PODS = "/api/v1/namespaces/default/pods"
JOBS = "/apis/batch/v1/namespaces/default/jobs"
JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets"


@pytest.fixture(scope="module")
def sb():
    with Sandbox(slices={"v5p-8": 1}, require_token=True) as box:
        yield box


def raw(sb, method, path, body=None, headers=None, token=True, host=None):
    """One request over HTTPS (trusting the sandbox's certificate, as its kubeconfig does) with exactly
    these headers: the sandbox's token unless `token` is False (or another string), Host `host` when
    given (None: the one http.client sends, 127.0.0.1:PORT)."""
    tls = client_context(base64.b64encode(sb.certificate).decode())
    conn = http.client.HTTPSConnection("127.0.0.1", sb.server.port, timeout=10, context=tls)
    hdrs = dict(headers or {})
    if token:
        hdrs["Authorization"] = f"Bearer {sb.token if token is True else token}"
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.putrequest(method, path, skip_host=host is not None, skip_accept_encoding=True)
    if host:
        conn.putheader("Host", host)
    for k, v in hdrs.items():
        conn.putheader(k, v)
    if data is not None:
        conn.putheader("Content-Length", str(len(data)))
    conn.endheaders(data)
    r = conn.getresponse()
    text = r.read()
    conn.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text.decode()


def job(name: str, command=("sh", "-c", "id > /tmp/pwned")) -> dict:
    """A bare Job whose pod would run `command` as the sandbox's user."""
    pod = tiny_jobset(name)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    pod["spec"]["containers"][0]["command"] = list(command)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": {"template": pod}}


def jobs(sb) -> list[str]:
    with sb.server.store.lock:
        return [j["metadata"]["name"] for j in sb.world.items("Job", None)]


def status_of(answer, code, reason):
    assert isinstance(answer, dict), answer
    assert (answer["kind"], answer["status"], answer["code"], answer["reason"]) == (
        "Status",
        "Failure",
        code,
        reason,
    ), answer


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("GET", PODS, None),
        ("GET", "/api/v1/nodes", None),
        ("GET", "/version", None),
        ("GET", "/apis", None),
        ("POST", JOBS, job("anon")),
        ("POST", JOBSETS, tiny_jobset("anon-js", queue=None)),
        ("DELETE", "/api/v1/nodes/gke-v5p-8-np-0-0000", None),
    ],
)
def test_a_request_without_the_token_is_401_and_changes_nothing(sb, method, path, body):
    headers = {"Content-Type": "application/json"} if body is not None else {}
    code, answer = raw(sb, method, path, body, headers, token=False)
    assert code == 401
    status_of(answer, 401, "Unauthorized")
    assert answer["message"] == "Unauthorized"
    assert "anon" not in jobs(sb) and sb.world.get("JobSet", "default", "anon-js") is None
    assert sb.world.get("Node", "", "gke-v5p-8-np-0-0000") is not None


@pytest.mark.parametrize(
    "authorization",
    ["Bearer not-the-token", "Bearer ", "Basic YWRtaW46YWRtaW4=", "{token}x", "Bearer {token}x", "{token}"],
)
def test_a_wrong_token_is_401(sb, authorization):
    auth = authorization.format(token=sb.token)
    code, answer = raw(sb, "POST", JOBS, job("wrong"), {"Authorization": auth}, token=False)
    assert code == 401
    status_of(answer, 401, "Unauthorized")
    code, _ = raw(sb, "GET", PODS, headers={"Authorization": auth}, token=False)
    assert code == 401
    assert "wrong" not in jobs(sb)


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_the_kubeconfigs_token_drives_it_through_the_kubernetes_client(sb, tmp_path):
    from kubernetes import client

    from olmo_ctl.backends.kube import make_api_client

    kc = sb.write_kubeconfig(tmp_path / "kubeconfig")
    api = client.CustomObjectsApi(make_api_client(kubeconfig=str(kc)))
    made = api.create_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", "default", "jobsets", tiny_jobset("with-token", queue=None)
    )
    assert made["metadata"]["name"] == "with-token"
    anonymous = client.CustomObjectsApi(make_api_client(host=sb.url, verify_ssl=False))
    with pytest.raises(client.ApiException) as e:
        anonymous.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "default", "jobsets")
    assert e.value.status == 401
    code, answer = raw(
        sb, "GET", "/api/v1/nodes", headers={"Authorization": f"bearer  {sb.token}"}, token=False
    )
    assert code == 200 and answer["kind"] == "NodeList"  # the scheme is case-insensitive, as in Go


@pytest.mark.parametrize(
    "host",
    ["evil.example", "evil.example:{port}", "127.0.0.1", "127.0.0.1:1", "localhost.evil.example:{port}"],
)
def test_a_foreign_host_is_refused_even_with_the_token(sb, host):
    """DNS rebinding: a page of evil.example resolved to 127.0.0.1 still sends Host evil.example."""
    host = host.format(port=sb.server.port)
    code, answer = raw(sb, "POST", JOBS, job("rebound"), {"Content-Type": "application/json"}, host=host)
    assert code == 421
    status_of(answer, 421, "MisdirectedRequest")
    assert host in answer["message"]
    code, _ = raw(sb, "GET", PODS, host=host)
    assert code == 421
    assert "rebound" not in jobs(sb)


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}", "[::1]:{port}"])
def test_the_servers_own_addresses_are_accepted(sb, host):
    code, answer = raw(sb, "GET", "/api/v1/nodes", host=host.format(port=sb.server.port))
    assert code == 200 and answer["kind"] == "NodeList"


@pytest.mark.parametrize(
    "ctype",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json-patch+json",  # a patch type is no body to create from
    ],
)
def test_a_body_of_another_type_is_415_and_creates_nothing(sb, ctype):
    """What a web page can POST without a CORS preflight (text/plain, a form's types) is no API body."""
    code, answer = raw(sb, "POST", JOBS, job("plain"), {"Content-Type": ctype})
    assert code == 415
    status_of(answer, 415, "UnsupportedMediaType")
    assert answer["message"].startswith("the body of the request was in an unknown format")
    assert "plain" not in jobs(sb)


def test_patch_and_put_take_only_their_types(sb):
    name = "gke-v5p-8-np-0-0000"
    for ctype in ("text/plain", "application/json", ""):
        headers = {"Content-Type": ctype} if ctype else {}
        code, answer = raw(
            sb, "PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": {"x": "y"}}}, headers
        )
        assert code == 415, (ctype, answer)
        status_of(answer, 415, "UnsupportedMediaType")
    assert "x" not in sb.world.get("Node", "", name)["metadata"]["labels"]
    code, node = raw(sb, "GET", f"/api/v1/nodes/{name}")
    code, answer = raw(sb, "PUT", f"/api/v1/nodes/{name}", node, {"Content-Type": "text/plain"})
    assert code == 415
    code, answer = raw(
        sb,
        "PATCH",
        f"/api/v1/nodes/{name}",
        {"metadata": {"labels": {"patched": "yes"}}},
        {"Content-Type": "application/merge-patch+json"},
    )
    assert code == 200 and answer["metadata"]["labels"]["patched"] == "yes"


def test_yaml_and_no_content_type_are_json_as_kube_apiserver_reads_them(sb):
    import yaml

    code, made = raw(
        sb, "POST", JOBS, yaml.safe_dump(job("as-yaml")).encode(), {"Content-Type": "application/yaml"}
    )
    assert code == 201 and made["metadata"]["name"] == "as-yaml", made
    code, made = raw(sb, "POST", JOBS, job("no-type"))
    assert code == 201 and made["metadata"]["name"] == "no-type", made
    code, answer = raw(sb, "POST", JOBS, b"kind: [", {"Content-Type": "application/yaml"})
    assert code == 400 and answer["reason"] == "BadRequest"


def test_a_bare_pod_without_status_is_created_pending(sb):
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "bare"},
        "spec": {"containers": [{"name": "c", "image": "busybox", "command": ["true"]}]},
    }
    code, made = raw(sb, "POST", PODS, pod, {"Content-Type": "application/json"})
    assert code == 201, made
    assert made["status"]["phase"] in ("Pending", "Running")  # Pending, then the scheduler's
    assert [c["name"] for c in made["status"]["containerStatuses"]] == ["c"]
    code, _ = raw(sb, "GET", PODS)
    assert code == 200  # the cluster still answers


@pytest.mark.parametrize(
    "path,body,cause",
    [
        (PODS, {"kind": "Pod", "metadata": {"name": "no-spec"}}, "spec.containers: Required value"),
        (
            PODS,
            {"metadata": {"name": "null"}, "spec": None, "status": None},
            "spec.containers: Required value",
        ),
        (
            PODS,
            {"metadata": {"name": "empty"}, "spec": {"containers": []}},
            "spec.containers: Required value",
        ),
        (
            PODS,
            {"metadata": {"name": "no-image"}, "spec": {"containers": [{"name": "c"}]}},
            "spec.containers[0].image: Required value",
        ),
        (
            PODS,
            {
                "metadata": {"name": "typed"},
                "spec": {"containers": [{"name": "c", "image": "i", "command": "id"}]},
            },
            "spec.containers[0].command: Invalid value",
        ),
        (
            PODS,
            {
                "metadata": {"name": "labels", "labels": "x"},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
            "metadata.labels: Invalid value",
        ),
        (JOBS, {"metadata": {"name": "no-spec"}}, "spec.template.spec.containers: Required value"),
        (
            JOBS,
            {"metadata": {"name": "no-template"}, "spec": {}},
            "spec: Invalid value: 'template' is a required",
        ),
        (
            JOBS,
            {**job("always"), "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}},
            'spec.template.spec.restartPolicy: Unsupported value: "Always"',
        ),
        (JOBSETS, {"metadata": {"name": "no-spec"}}, "spec.replicatedJobs: Required value"),
        (
            JOBSETS,
            {"metadata": {"name": "no-job"}, "spec": {"replicatedJobs": [{"name": "a", "template": {}}]}},
            "spec.replicatedJobs[0].template.spec: Required value",
        ),
        (
            "/apis/kueue.x-k8s.io/v1beta2/namespaces/default/workloads",
            {"metadata": {"name": "no-podsets"}, "spec": {}},
            "spec.podSets: Required value",
        ),
        (
            "/apis/apps/v1/namespaces/default/daemonsets",
            {"metadata": {"name": "null"}, "spec": None},
            "spec.selector: Required value",
        ),
    ],
)
def test_an_object_the_cluster_cannot_run_is_422_never_a_server_bug(sb, path, body, cause):
    code, answer = raw(sb, "POST", path, body, {"Content-Type": "application/json"})
    assert code == 422, answer
    status_of(answer, 422, "Invalid")
    assert cause in answer["message"], answer["message"]
    code, answer = raw(sb, "GET", PODS)
    assert code == 200, answer  # nothing half-stored that breaks the next request


def test_a_status_the_controllers_cannot_read_is_422(sb):
    pod = {
        "metadata": {"name": "unplaced"},
        "spec": {"nodeSelector": {"no-such": "node"}, "containers": [{"name": "c", "image": "i"}]},
    }
    code, pod = raw(sb, "POST", PODS, pod, {"Content-Type": "application/json"})
    assert code == 201 and pod["status"]["phase"] == "Pending", pod
    del pod["metadata"]["resourceVersion"]  # the scheduler has written it since
    for bad in ({"conditions": "x"}, {"conditions": [None]}, {"containerStatuses": [{}]}, {"phase": 1}):
        code, answer = raw(
            sb, "PUT", f"{PODS}/unplaced/status", {**pod, "status": bad}, {"Content-Type": "application/json"}
        )
        assert code == 422, (bad, answer)
    code, answer = raw(
        sb,
        "PATCH",
        f"{PODS}/unplaced/status",
        {"status": None},
        {"Content-Type": "application/merge-patch+json"},
    )
    assert code == 200 and answer["status"]["phase"] == "Pending"  # a write without the status keeps it
    code, answer = raw(sb, "GET", PODS)
    assert code == 200


@pytest.mark.parametrize("res", BUILTIN, ids=lambda r: r.kind)
def test_no_kind_posted_bare_is_a_server_bug(sb, res):
    """Every kind served, POSTed with nothing but a name (and with a null spec): created or refused
    (4xx), and the cluster answers after it."""
    version = res.versions[-1]
    path = (f"/apis/{res.group}/{version}" if res.group else "/api/v1") + (
        "/namespaces/default" if res.namespaced else ""
    )
    for i, extra in enumerate(({}, {"spec": None}, {"spec": {}})):
        body = {
            "apiVersion": res.api_version(version),
            "kind": res.kind,
            "metadata": {"name": f"bare-{i}"},
            **extra,
        }
        code, answer = raw(sb, "POST", f"{path}/{res.plural}", body, {"Content-Type": "application/json"})
        assert code in (201, 409, 422), answer
        code, answer = raw(sb, "GET", f"{path}/{res.plural}")
        assert code == 200, answer
        raw(sb, "DELETE", f"{path}/{res.plural}/bare-{i}")  # no bare node for the other tests' pods
