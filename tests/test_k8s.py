"""backend: kubernetes without a cluster.

1. The rendered ConfigMap, Service and Job validate against Kubernetes 1.32's JSON schemas (strict: unknown
   fields are errors; tests/data/k8s-schemas, generated from the Kubernetes OpenAPI) and round-trip through the
   official client's models unchanged.
2. The backend talks HTTP, through the real `kubernetes` client configured from a kubeconfig, to a fake API
   server (FakeCluster below) that records every request. The fake also plays kubelet: when the Job is
   created it runs each pod's container command from the manifest as a local process (the ConfigMap written
   where the pod would mount it, pod 0's DNS name replaced by 127.0.0.1), serves its output as the pod log
   (chunked, follow=true), reports pod phases and the Job's conditions, and kills the processes when the Job
   is deleted. What is NOT exercised: a real API server's admission/defaulting, the scheduler, image pulls,
   cluster DNS, and pods on separate machines.
"""

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import jsonschema
import psutil
import pytest
from tinybp import tiny_blueprint

pytestmark = pytest.mark.system

pytest.importorskip("kubernetes")

from verlflow.core.blueprint import KubernetesSpec  # noqa: E402
from verlflow.core.orchestrate.backends.kubernetes import INDEX_KEY, KubernetesBackend, render  # noqa: E402
from verlflow.core.orchestrate.launcher import FailureKind, LaunchSpec, StageFailure  # noqa: E402

SCHEMAS = Path(__file__).parent / "data" / "k8s-schemas"
KIND_SCHEMA = {"ConfigMap": "configmap-v1.json", "Service": "service-v1.json", "Job": "job-batch-v1.json"}


def _cfg(**kw):
    base = dict(namespace="ml", image="registry.example/verlflow:0.1", gpus_per_node=8, cpu="32", memory="200Gi",
                env_from_secret="verlflow-s3", pvc="verlflow-data", pvc_mount="/data",
                node_selector={"nvidia.com/gpu.product": "H200"},
                tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                service_account="verlflow")
    base.update(kw)
    return KubernetesSpec(**base)


def _validate(manifest):
    schema = json.loads((SCHEMAS / KIND_SCHEMA[manifest["kind"]]).read_text())
    jsonschema.Draft7Validator(schema).validate(manifest)


def _roundtrip(manifest):
    """Deserialize into the client's models (unknown fields are dropped, required ones enforced) and back."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    model = {"ConfigMap": "V1ConfigMap", "Service": "V1Service", "Job": "V1Job"}[manifest["kind"]]
    obj = api._ApiClient__deserialize(json.loads(json.dumps(manifest)), model)
    return api.sanitize_for_serialization(obj)


def test_manifests_match_the_kubernetes_schemas(tmp_path):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({"stage": "update", "scratch": "/tmp/x"}))
    spec = LaunchSpec("verlflow.core.stages.update", [str(job_file)], job_arg=0, nproc_per_node=8, nnodes=4, timeout_s=3600,
                      env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    m = render(spec, _cfg(), "vf-update-1234abcd", "rid1")
    for manifest in m.values():
        _validate(manifest)
        assert _roundtrip(manifest) == manifest  # every field is one the API knows, spelled as it spells it
    job = m["job"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"], job["backoffLimit"]) == \
        ("Indexed", 4, 4, 0)
    pod = job["template"]["spec"]
    assert pod["subdomain"] == m["service"]["metadata"]["name"] == "vf-update-1234abcd"
    assert m["service"]["spec"]["clusterIP"] == "None" and m["service"]["spec"]["publishNotReadyAddresses"]
    assert m["service"]["spec"]["selector"].items() <= job["template"]["metadata"]["labels"].items()
    c = pod["containers"][0]
    assert c["command"][c["command"].index("--rdzv") + 1] == "vf-update-1234abcd-0.vf-update-1234abcd.ml.svc:29400"
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8", "cpu": "32", "memory": "200Gi"}
    assert c["envFrom"] == [{"secretRef": {"name": "verlflow-s3"}}]
    assert "OMP_NUM_THREADS" not in {e["name"] for e in c["env"]}  # the submitter's core count is not the pod's
    assert json.loads(m["configmap"]["data"]["job.json"])["stage"] == "update"
    launch = json.loads(m["configmap"]["data"]["launch.json"])
    assert launch["args"] == ["/etc/verlflow/job.json"] and launch["rdzv_id"] == "rid1"
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "verlflow-data"}} in pod["volumes"]


def test_pods_keep_compiled_kernels_on_the_pvc_not_at_the_submitters_path(tmp_path):
    """Each stage is a new pod: its compile caches (torch.compile's, Triton's, the static engine's timings) go on
    the pvc where there is one, so the next stage's pod reuses what this one compiled, instead of the submitter's
    own cache path (a folder on another machine) inside the pod's throw-away disk."""
    job_file = tmp_path / "job.json"
    job_file.write_text("{}")
    submitter = {"TORCHINDUCTOR_CACHE_DIR": "/home/me/.cache/verlflow/inductor", "HF_HUB_OFFLINE": "1"}

    def cache_env(**cfg):
        spec = LaunchSpec("verlflow.core.stages.update", [str(job_file)], job_arg=0, env=dict(submitter))
        c = render(spec, _cfg(**cfg), "vf-update-1", "r")["job"]["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["HF_HUB_OFFLINE"] == "1"
        return {k: env[k] for k in ("VERLFLOW_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}

    assert cache_env() == {"VERLFLOW_CACHE_DIR": "/data/.verlflow-cache",
                           "TORCHINDUCTOR_CACHE_DIR": "/data/.verlflow-cache/inductor",
                           "TRITON_CACHE_DIR": "/data/.verlflow-cache/triton"}
    assert cache_env(pvc=None)["TORCHINDUCTOR_CACHE_DIR"] == "/scratch/cache/inductor"  # the pod's emptyDir
    assert cache_env(cache_dir="/mnt/kernels")["TRITON_CACHE_DIR"] == "/mnt/kernels/triton"
    with pytest.raises(ValueError, match="(?s)cache_dir.*not an absolute path"):
        _cfg(cache_dir="cache")


def test_schema_check_catches_a_misspelled_field(tmp_path):
    m = render(LaunchSpec("verlflow.core.testing.probe", [], nnodes=2), _cfg(), "vf-probe-1", "r")
    bad = json.loads(json.dumps(m["job"]))
    bad["spec"]["completionsMode"] = "Indexed"
    with pytest.raises(jsonschema.ValidationError, match="completionsMode"):
        _validate(bad)
    assert "completionsMode" not in _roundtrip(bad)["spec"]
    bad = json.loads(json.dumps(m["service"]))
    bad["spec"]["clusterIP"] = None
    bad["spec"]["ports"][0]["port"] = "rdzv"
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad)


def test_blueprint_needs_an_image():
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.errors import BlueprintError

    with pytest.raises(BlueprintError, match="needs kubernetes.image"):
        load_blueprint(None, ["resources.backend=kubernetes"])
    bp = load_blueprint(None, ["resources.backend=kubernetes", "resources.kubernetes.image=r/v:1",
                               "resources.kubernetes.namespace=ml"])
    assert bp.resources.kubernetes.namespace == "ml"


# ---------------------------------------------------------------------------------------------------
# The fake API server (and kubelet).


def _kill_tree(pid):
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


class Pod:
    def __init__(self, name, index, node):
        self.name, self.index, self.node = name, index, node
        self.lines: list[bytes] = []
        self.cond = threading.Condition()
        self.proc = None
        self.code = None

    def phase(self):
        if self.proc is None:
            return "Pending"
        if self.code is None:
            return "Running"
        return "Succeeded" if self.code == 0 else "Failed"


class FakeCluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.requests: list[tuple] = []
        self.objects: dict[tuple, dict] = {}
        self.pods: dict[str, list[Pod]] = {}
        self.deleted_jobs: set[str] = set()
        self.rdzv_port = None
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n)) if n else None

            def do_POST(self):
                body = self._body()
                fake.requests.append(("POST", self.path, body, self.headers.get("Authorization")))
                m = re.fullmatch(r"/(?:api/v1|apis/batch/v1)/namespaces/([^/]+)/(configmaps|services|jobs)", self.path)
                if not m:
                    return self._send(404, {"kind": "Status", "code": 404})
                body.setdefault("metadata", {})["uid"] = f"uid-{len(fake.requests)}"
                fake.objects[(m[2], body["metadata"]["name"])] = body
                if m[2] == "jobs":
                    fake.start_pods(body)
                self._send(201, body)

            def do_DELETE(self):
                url = urllib.parse.urlparse(self.path)
                body = self._body()
                fake.requests.append(("DELETE", url.path, {**dict(urllib.parse.parse_qsl(url.query)), **(body or {})},
                                      self.headers.get("Authorization")))
                m = re.fullmatch(r"/(?:api/v1|apis/batch/v1)/namespaces/([^/]+)/(configmaps|services|jobs)/([^/]+)",
                                 url.path)
                obj = fake.objects.pop((m[2], m[3]), None) if m else None
                if obj is None:
                    return self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                if m[2] == "jobs":
                    fake.delete_job(m[3])
                # As the API server answers: a Service comes back as the deleted object, the others as a Status.
                self._send(200, obj if m[2] == "services" else {"kind": "Status", "apiVersion": "v1",
                                                                "status": "Success"})

            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                q = dict(urllib.parse.parse_qsl(url.query))
                fake.requests.append(("GET", url.path, q, self.headers.get("Authorization")))
                if m := re.fullmatch(r"/apis/batch/v1/namespaces/([^/]+)/jobs/([^/]+)/status", url.path):
                    job = fake.objects.get(("jobs", m[2]))
                    return self._send(200, fake.job_with_status(job)) if job else self._send(404, {"code": 404})
                if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", url.path):
                    name = q.get("labelSelector", "").split("=", 1)[1]
                    pods = [fake.pod_json(name, p) for p in fake.pods.get(name, [])]
                    return self._send(200, {"kind": "PodList", "apiVersion": "v1", "items": pods})
                if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log", url.path):
                    pod = next((p for ps in fake.pods.values() for p in ps if p.name == m[2]), None)
                    if pod is None:
                        return self._send(404, {"code": 404})
                    return self._stream(pod, q.get("follow") == "true")
                self._send(404, {"code": 404})

            def _stream(self, pod, follow):
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                sent = 0
                while True:
                    with pod.cond:
                        while follow and sent == len(pod.lines) and pod.code is None:
                            pod.cond.wait(0.5)
                        new, done = pod.lines[sent:], pod.code is not None or not follow
                    for chunk in new:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                    sent += len(new)
                    if done and sent == len(pod.lines):
                        break
                self.wfile.write(b"0\r\n\r\n")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    # kubelet: the container command of each pod, as a local process
    def start_pods(self, job):
        name, spec = job["metadata"]["name"], job["spec"]
        cm = self.objects[("configmaps", name)]
        container = spec["template"]["spec"]["containers"][0]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.rdzv_port = s.getsockname()[1]
        pods = self.pods[name] = []
        for index in range(spec["completions"]):
            pod = Pod(f"{name}-{index}-x{index}", index, f"node-{'ab'[index % 2]}")
            pods.append(pod)
            root = self.tmp / pod.name
            mount = root / "etc-verlflow"
            mount.mkdir(parents=True)
            for key, text in cm["data"].items():  # the ConfigMap volume, and the pod's own emptyDir /scratch
                text = text.replace("/etc/verlflow", str(mount)).replace('"/scratch', f'"{root}/scratch')
                (mount / key).write_text(text)
            cmd = [sys.executable if c == "python" else c for c in container["command"]]
            cmd = [str(mount / "launch.json") if c == "/etc/verlflow/launch.json" else c for c in cmd]
            i = cmd.index("--rdzv")
            host, port = cmd[i + 1].rsplit(":", 1)
            assert host == f"{name}-0.{name}.{job['metadata']['namespace']}.svc" and port == "29400"
            cmd[i + 1] = f"127.0.0.1:{self.rdzv_port}"  # no cluster DNS here
            env = {e["name"]: e["value"].replace("/scratch", f"{root}/scratch") for e in container["env"]
                   if "value" in e}  # the pod's scratch (its caches too) is this pod's folder here
            env.update(JOB_COMPLETION_INDEX=str(index), VERLFLOW_NODE_NAME=pod.node)
            threading.Thread(target=self._run, args=(pod, cmd, {**os.environ, **env}), daemon=True).start()

    def _run(self, pod, cmd, env):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=os.getcwd())
        with pod.cond:
            pod.proc = proc
        for raw in iter(proc.stdout.readline, b""):
            with pod.cond:
                pod.lines.append(raw)
                pod.cond.notify_all()
        code = proc.wait()
        with pod.cond:
            pod.code = code
            pod.cond.notify_all()

    def delete_job(self, name):
        self.deleted_jobs.add(name)
        pods = self.pods.get(name, [])
        for p in pods:  # kubelet: SIGTERM, the grace period, then SIGKILL
            if p.proc and p.code is None:
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while any(p.proc and p.proc.poll() is None for p in pods) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in pods:  # the container runtime kills every process of the container
            if p.proc and p.proc.poll() is None:
                _kill_tree(p.proc.pid)
        self.pods[name] = []

    def job_with_status(self, job):
        pods = self.pods.get(job["metadata"]["name"], [])
        phases = [p.phase() for p in pods]
        status = {"active": sum(ph in ("Pending", "Running") for ph in phases),
                  "succeeded": phases.count("Succeeded"), "failed": phases.count("Failed")}
        if status["failed"]:
            status["conditions"] = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]
        elif pods and status["succeeded"] == len(pods):
            status["conditions"] = [{"type": "Complete", "status": "True"}]
        return {**job, "status": status}

    def pod_json(self, job_name, pod):
        job = self.objects.get(("jobs", job_name)) or {"spec": {"template": {"metadata": {}, "spec": {}}}}
        tmpl = job["spec"]["template"]
        phase = pod.phase()
        state = {"running": {}} if phase == "Running" else \
            {"terminated": {"exitCode": pod.code, "reason": "Completed" if pod.code == 0 else "Error"}} \
            if phase in ("Succeeded", "Failed") else {"waiting": {"reason": "ContainerCreating"}}
        return {"metadata": {"name": pod.name, "namespace": "ml",
                             "labels": {**tmpl["metadata"].get("labels", {}), INDEX_KEY: str(pod.index)},
                             "annotations": {INDEX_KEY: str(pod.index)}},
                "spec": {**tmpl["spec"], "nodeName": pod.node},
                "status": {"phase": phase, "containerStatuses": [
                    {"name": "torchrun", "image": "x", "imageID": "x", "ready": phase == "Running",
                     "restartCount": 0, "state": state}]}}

    def close(self):
        for pods in self.pods.values():
            for p in pods:
                if p.proc and p.proc.poll() is None:
                    _kill_tree(p.proc.pid)
        self.server.shutdown()


@pytest.fixture
def fake_k8s(tmp_path, monkeypatch):
    fake = FakeCluster(tmp_path / "pods")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
        "users": [{"name": "u", "user": {"token": "test-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": "ml"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield fake
    fake.close()


def _calls(fake):
    return [(m, re.sub(r"vf-[a-z0-9-]+?-[0-9a-f]{8}", "NAME", p)) for m, p, *_ in fake.requests if m != "GET"]


class Lines(list):
    t0 = time.monotonic()

    def __call__(self, line):
        if os.environ.get("VERLFLOW_TEST_ECHO"):
            print(f"{time.monotonic() - self.t0:7.2f} {line}")
        self.append(line)

    def text(self):
        return "\n".join(self)


@pytest.mark.slow(reason="covered by test_k8s::test_manifests_match_the_kubernetes_schemas and test_slurm's jobs")
def test_stage_runs_as_two_pods_through_the_api(fake_k8s, tiny_kit, tmp_path):
    """run_stage('validate') with backend kubernetes: 2 pods x 1 process, the real client, logs streamed."""
    from verlflow.core.orchestrate.runner import RunContext, run_stage

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", resources__backend="kubernetes", resources__nnodes=2,
                        resources__nproc_per_node=1, resources__kubernetes__image="verlflow:test",
                        resources__kubernetes__namespace="ml")
    lines = Lines()
    t0 = time.monotonic()
    res = run_stage(RunContext(bp, "k8", on_line=lines), "validate", "init", {})
    print(f"validate via fake Kubernetes: {time.monotonic() - t0:.1f} s")
    assert res.manifest["world_size"] == 2
    text = lines.text()
    assert "sum over 2 ranks = 3.0" in text
    assert "[verlflow-node] task 0 on node node-a" in text and "[verlflow-node] task 1 on node node-b" in text
    assert _calls(fake_k8s) == [
        ("POST", "/api/v1/namespaces/ml/configmaps"), ("POST", "/api/v1/namespaces/ml/services"),
        ("POST", "/apis/batch/v1/namespaces/ml/jobs"), ("DELETE", "/apis/batch/v1/namespaces/ml/jobs/NAME"),
        ("DELETE", "/api/v1/namespaces/ml/services/NAME"), ("DELETE", "/api/v1/namespaces/ml/configmaps/NAME")]
    assert all(auth == "Bearer test-token" for *_, auth in fake_k8s.requests)
    job_post = next(r for r in fake_k8s.requests if r[1].endswith("/jobs") and r[0] == "POST")
    _validate({k: v for k, v in job_post[2].items()})  # what went over the wire is a valid Job
    logs = [r for r in fake_k8s.requests if r[1].endswith("/log")]
    assert len(logs) == 2 and all(r[2]["follow"] == "true" and r[2]["container"] == "torchrun" for r in logs)
    delete = next(r for r in fake_k8s.requests if r[0] == "DELETE" and "/jobs/" in r[1])
    assert delete[2].get("propagationPolicy") == "Foreground"


@pytest.mark.slow(reason="covered by test_slurm::test_failing_rank_names_its_node_and_rank")
def test_failing_rank_names_its_pod_node_and_rank(fake_k8s):
    lines = Lines()
    spec = LaunchSpec("verlflow.core.testing.probe", ["--mode", "raise"], nproc_per_node=1, nnodes=2, timeout_s=120)
    with pytest.raises(StageFailure) as info:
        KubernetesBackend(_cfg(gpus_per_node=0)).launch(spec, on_line=lines)
    exc = info.value
    print(f"\n{str(exc)[:300]}")  # what the task's log shows (pytest -s)
    # rank 1 raised; its exit code is 1, or -6 when gloo aborts in the interpreter's shutdown after the error
    assert exc.kind is FailureKind.USER_ERROR and exc.rank == 1 and exc.exitcode in (1, -6)
    assert "ValueError: boom-123" in str(exc) and "probe.py" in exc.traceback
    node = str(exc).split(" on node ")[1].split(" (")[0]
    task = int(str(exc).split(", task ")[1].split(")")[0])
    assert node == f"node-{'ab'[task]}"
    assert "Kubernetes Job ml/vf-probe-" in str(exc)
    assert ("DELETE" in {m for m, *_ in fake_k8s.requests}) and not any(fake_k8s.pods.values())


@pytest.mark.slow(reason="covered by test_slurm::test_cancel_and_timeout_leave_no_job")
def test_cancel_deletes_the_job_and_its_pods(fake_k8s):
    lines = Lines()
    cancel = threading.Event()
    rdzv_id = f"vfk8s-cancel-{os.getpid()}"
    spec = LaunchSpec("verlflow.core.testing.probe", ["--mode", "hang"], nproc_per_node=1, nnodes=2, rdzv_id=rdzv_id,
                      timeout_s=300)
    box = {}

    def run():
        try:
            KubernetesBackend(_cfg(gpus_per_node=0), poll_s=0.3).launch(spec, on_line=lines, cancel=cancel)
        except StageFailure as e:
            box["exc"] = e

    th = threading.Thread(target=run)
    th.start()
    deadline = time.monotonic() + 120
    while lines.text().count("all_reduce=2") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lines.text().count("all_reduce=2") == 2, lines.text()
    cancel.set()
    th.join(120)
    assert not th.is_alive() and box["exc"].kind is FailureKind.CANCELLED
    assert [c for c in _calls(fake_k8s) if c[0] == "DELETE"] == [
        ("DELETE", "/apis/batch/v1/namespaces/ml/jobs/NAME"), ("DELETE", "/api/v1/namespaces/ml/services/NAME"),
        ("DELETE", "/api/v1/namespaces/ml/configmaps/NAME")]
    assert not fake_k8s.objects  # nothing left on the "cluster"
    left = [p for p in psutil.process_iter(["cmdline"])
            if rdzv_id in (p.info["cmdline"] or ()) or _env(p).get("TORCHELASTIC_RUN_ID") == rdzv_id]
    assert not left


def _env(p):
    try:
        return p.environ()
    except psutil.Error:
        return {}


ROOT = Path(__file__).resolve().parent.parent
MODELS = {"ConfigMap": "V1ConfigMap", "Service": "V1Service", "Job": "V1Job", "ServiceAccount": "V1ServiceAccount",
          "Role": "V1Role", "RoleBinding": "V1RoleBinding", "Deployment": "V1Deployment"}


def test_example_blueprint_renders_the_shipped_manifests(tmp_path):
    """infra/k8s/qwen2.5-1.5b-2nodes.yaml loads, and infra/k8s/example-update.yaml is what verlflow renders for
    its update stage (VERLFLOW_REGEN_EXAMPLES=1 rewrites the file); every document matches the schemas."""
    import yaml

    from verlflow.core.blueprint import load_blueprint

    bp = load_blueprint(ROOT / "infra/k8s/qwen2.5-1.5b-2nodes.yaml")
    res = bp.resources
    assert (res.backend, res.world_size, res.kubernetes.namespace) == ("kubernetes", 16, "ml")
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({"stage": "update", "run_id": "qwen-nightly-1a2b3c4d", "iteration": 3,
                                    "note": "the whole job file (blueprint, inputs, manifest skeleton) goes here"}))
    spec = LaunchSpec("verlflow.core.stages.update", [str(job_file)], job_arg=0, nproc_per_node=8, nnodes=2,
                      timeout_s=res.stage_timeout_s, env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    m = render(spec, res.kubernetes, "vf-update-0123abcd", "vf-0123abcd")
    text = "# What verlflow creates for one stage (update, 2 pods x 8 GPUs) of infra/k8s/qwen2.5-1.5b-2nodes.yaml.\n" \
        + yaml.safe_dump_all([m["configmap"], m["service"], m["job"]], sort_keys=False, width=120)
    example = ROOT / "infra/k8s/example-update.yaml"
    if os.environ.get("VERLFLOW_REGEN_EXAMPLES"):
        example.write_text(text)
    assert example.read_text() == text
    for doc in yaml.safe_load_all(text):
        _validate(doc)


def test_infra_kubernetes_files_are_valid_objects():
    """rbac.yaml and worker.yaml: every document round-trips through the client's models unchanged."""
    import yaml
    from kubernetes.client import ApiClient

    api = ApiClient()
    for f in ("rbac.yaml", "worker.yaml"):
        for doc in yaml.safe_load_all((ROOT / "infra/k8s" / f).read_text()):
            obj = api._ApiClient__deserialize(json.loads(json.dumps(doc)), MODELS[doc["kind"]])
            assert api.sanitize_for_serialization(obj) == doc, f


def test_compose_file_matches_the_compose_spec():
    """infra/compose.yaml against the Compose Specification's JSON schema (tests/data/compose; not run here:
    this machine has no Docker daemon)."""
    import yaml

    compose = yaml.safe_load((ROOT / "infra/compose.yaml").read_text())
    schema = json.loads((Path(__file__).parent / "data/compose/compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(compose)
    assert set(compose["services"]) == {"postgres", "prefect-server", "minio", "minio-init", "worker"}
    env = compose["services"]["prefect-server"]["environment"]
    assert env["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    # No secret is written in the file: every credential comes from infra/.env.
    text = (ROOT / "infra/compose.yaml").read_text()
    assert "change-me" not in text and re.search(r"PASSWORD: \$\{", text)
