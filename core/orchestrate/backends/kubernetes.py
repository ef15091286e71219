"""backend: kubernetes — a stage is an indexed batch/v1 Job (one pod per node) and a headless Service.

Why an indexed Job + headless Service, not a Kubeflow TrainJob/PyTorchJob or a JobSet: it runs on any cluster
(batch/v1 Indexed Jobs are GA since Kubernetes 1.24) with no operator or CRD to install and no controller
version to match; it is what Kubeflow Trainer v2 and JobSet themselves render underneath (indexed Jobs whose
pods find each other through a headless Service), and torchrun only needs what it gives: a stable index per pod
(JOB_COMPLETION_INDEX, the node's place) and a stable DNS name for pod 0 (<job>-0.<service>), the c10d store.
Retries stay the task's decision (backoffLimit 0, like --max-restarts 0 under local and Slurm).

Per stage: a ConfigMap (the stage's job file and the launch file), the Service (clusterIP None,
publishNotReadyAddresses, so pod 0's name resolves before anything is ready) and the Job (completions =
parallelism = nnodes, completionMode Indexed, restartPolicy Never, subdomain = the Service). Each pod runs
`python -m verlflow.core.orchestrate.backends.node /etc/verlflow/launch.json --rdzv <job>-0.<svc>.<ns>.svc:<port> --head-index 0
--emit-errors`: torchrun with c10d, its error files printed to the log when it fails, so the diagnosis runs
here on the error records the logs carried. Secrets are never in a manifest: env_from_secret names a
Secret whose keys become the pods' environment.

The backend submits with the official `kubernetes` client (in-cluster config, else the kubeconfig and
resources.kubernetes.context), streams every pod's log (follow) into on_line while it runs, follows the Job's
conditions, and deletes Job (foreground: pods first), Service and ConfigMap at the end, on cancel and on timeout.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from verlflow.core.cachedir import compile_cache_env
from verlflow.core.errors import VerlflowError
from verlflow.core.orchestrate.backends.common import JobOutput, diagnose_job
from verlflow.core.orchestrate.launcher import FailureKind, LaunchResult, LaunchSpec, StageFailure
from verlflow.core.wait import wait_until

JOB_MOUNT = "/etc/verlflow"
SCRATCH = "/scratch"
CONTAINER = "torchrun"
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
_STUCK = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
          "CreateContainerError"}


class KubernetesError(VerlflowError):
    """The API refused or could not be reached (not a failure of the stage itself)."""


@dataclass
class KubernetesLaunchResult(LaunchResult):
    job_name: str = ""
    queued_s: float = 0.0  # created -> first pod running
    run_s: float = 0.0


def job_name(spec: LaunchSpec) -> str:
    stage = re.sub(r"[^a-z0-9-]", "-", spec.module.rsplit(".", 1)[-1].lower()).strip("-") or "stage"
    return f"vf-{stage[:20]}-{uuid.uuid4().hex[:8]}"  # a DNS-1035 label; pods' host names add -<index>


def _pod_cache_dir(cfg) -> str:
    """Where the pods keep their caches: cache_dir, else on the pvc, else the pod's own scratch."""
    if cfg.cache_dir:
        return cfg.cache_dir
    return f"{cfg.pvc_mount.rstrip('/')}/.verlflow-cache" if cfg.pvc else f"{SCRATCH}/cache"


def render(spec: LaunchSpec, cfg, name: str, rdzv_id: str) -> dict[str, dict]:
    """The three manifests of one stage job (plain dicts, as the API takes them)."""
    ns = cfg.namespace
    args = list(spec.args)
    data = {}
    job_arg = spec.job_arg
    if job_arg is not None:
        data["job.json"] = Path(args[job_arg]).read_text()
        args[job_arg] = f"{JOB_MOUNT}/job.json"
    data["launch.json"] = json.dumps({
        "module": spec.module, "args": args, "nproc_per_node": spec.nproc_per_node, "nnodes": spec.nnodes,
        "rdzv_id": rdzv_id, "job_arg": job_arg, "scratch_base": SCRATCH, "log_base": f"{SCRATCH}/logs"})
    labels = {"app.kubernetes.io/name": "verlflow", "app.kubernetes.io/component": "stage",
              "verlflow.io/job": name, "verlflow.io/stage": spec.module.rsplit(".", 1)[-1].strip("_")[:63],
              **cfg.labels}
    def meta():  # a fresh dict per object: nothing shared between the manifests
        return {"name": name, "namespace": ns, "labels": dict(labels)}

    rdzv = f"{name}-0.{name}.{ns}.svc:{cfg.rdzv_port}"
    # the submitter's core count is not the pod's; its cache folders are not the pod's either (a path on the
    # submitter's disk): the pods' own, on the pvc where there is one, so later pods reuse compiled kernels
    pod_env = {**spec.env, **compile_cache_env(_pod_cache_dir(cfg))}
    env = [{"name": k, "value": str(v)} for k, v in sorted(pod_env.items()) if k != "OMP_NUM_THREADS"]
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
    env.append({"name": "VERLFLOW_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    limits: dict[str, str] = {}
    if cfg.gpus_per_node:
        limits["nvidia.com/gpu"] = str(cfg.gpus_per_node)
    if cfg.cpu:
        limits["cpu"] = cfg.cpu
    if cfg.memory:
        limits["memory"] = cfg.memory
    mounts = [{"name": "job", "mountPath": JOB_MOUNT, "readOnly": True}, {"name": "scratch", "mountPath": SCRATCH},
              {"name": "dshm", "mountPath": "/dev/shm"}]  # NCCL and DataLoader workers need more than 64 MiB
    volumes = [{"name": "job", "configMap": {"name": name}}, {"name": "scratch", "emptyDir": {}},
               {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if cfg.pvc:
        mounts.append({"name": "data", "mountPath": cfg.pvc_mount})
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": cfg.pvc}})
    container = {
        "name": CONTAINER, "image": cfg.image, "imagePullPolicy": cfg.image_pull_policy,
        "command": [cfg.python, "-m", "verlflow.core.orchestrate.backends.node", f"{JOB_MOUNT}/launch.json", "--rdzv", rdzv,
                    "--head-index", "0", "--emit-errors"],
        "env": env, "ports": [{"name": "rdzv", "containerPort": cfg.rdzv_port, "protocol": "TCP"}],
        "resources": {"limits": limits, "requests": dict(limits)}, "volumeMounts": mounts,
    }
    if cfg.env_from_secret:
        container["envFrom"] = [{"secretRef": {"name": cfg.env_from_secret}}]
    pod_spec = {"restartPolicy": "Never", "subdomain": name, "containers": [container], "volumes": volumes,
                "terminationGracePeriodSeconds": 30}
    if cfg.service_account:
        pod_spec["serviceAccountName"] = cfg.service_account
    if cfg.node_selector:
        pod_spec["nodeSelector"] = dict(cfg.node_selector)
    if cfg.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in cfg.tolerations]
    job_spec = {"completionMode": "Indexed", "completions": spec.nnodes, "parallelism": spec.nnodes,
                "backoffLimit": 0, "ttlSecondsAfterFinished": cfg.ttl_seconds_after_finished,
                "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec}}
    if spec.timeout_s:  # a server-side guard if this process dies; our own timeout (from the start) fires first
        job_spec["activeDeadlineSeconds"] = int(spec.timeout_s) + 600
    return {
        "configmap": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(), "data": data},
        "service": {"apiVersion": "v1", "kind": "Service", "metadata": meta(),
                    "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                             "selector": {"verlflow.io/job": name},
                             "ports": [{"name": "rdzv", "port": cfg.rdzv_port, "targetPort": cfg.rdzv_port,
                                        "protocol": "TCP"}]}},
        "job": {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta(), "spec": job_spec},
    }


def api_client(cfg):
    """In-cluster config (a Prefect worker running as a pod), else the kubeconfig ($KUBECONFIG, ~/.kube/config)."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise KubernetesError("backend kubernetes needs the kubernetes client: pip install 'verlflow[k8s]'") from None
    try:
        conf = client.Configuration()
        config.load_incluster_config(client_configuration=conf)
        return client.ApiClient(conf)
    except config.ConfigException:
        pass
    try:
        import os

        # $KUBECONFIG read now, not when the client module was first imported
        return config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"), context=cfg.context)
    except config.ConfigException as e:
        raise KubernetesError(f"no Kubernetes configuration: not in a cluster and no usable kubeconfig ({e})") from None


def _cond(job) -> str | None:
    for c in (job.status.conditions or []) if job.status else []:
        if c.status == "True" and c.type in ("Complete", "Failed"):
            return c.type if c.type == "Complete" else f"Failed:{c.reason or ''}"
    return None


class KubernetesBackend:
    def __init__(self, cfg, client=None, poll_s: float = 1.0):
        self.cfg, self._client, self.poll_s = cfg, client, poll_s

    def _apis(self):
        from kubernetes import client as k

        api = self._client or api_client(self.cfg)
        return k.CoreV1Api(api), k.BatchV1Api(api)

    def launch(self, spec: LaunchSpec, on_line: Callable[[str], None] = print,
               cancel: threading.Event | None = None, grace_s: float = 5.0) -> KubernetesLaunchResult:
        from kubernetes.client.exceptions import ApiException

        core, batch = self._apis()
        ns, name = self.cfg.namespace, job_name(spec)
        rdzv_id = spec.rdzv_id or uuid.uuid4().hex[:12]
        spec = replace(spec, rdzv_id=rdzv_id)
        m = render(spec, self.cfg, name, rdzv_id)
        created = []
        t0 = time.monotonic()
        try:
            try:
                core.create_namespaced_config_map(ns, m["configmap"])
                created.append("configmap")
                core.create_namespaced_service(ns, m["service"])
                created.append("service")
                batch.create_namespaced_job(ns, m["job"])
                created.append("job")
            except ApiException as e:
                raise KubernetesError(f"creating {name} in namespace {ns} failed: {e.status} {e.reason}: "
                                      f"{(e.body or '')[:500]}") from None
            on_line(f"[k8s] created Job {ns}/{name} ({spec.nnodes} pod(s) x {spec.nproc_per_node}), "
                    f"Service and ConfigMap in {time.monotonic() - t0:.2f} s")
            return self._follow(core, batch, spec, name, on_line, cancel, t0)
        finally:
            self._delete(core, batch, name, created, wait="job" in created)

    def _follow(self, core, batch, spec, name, on_line, cancel, t0):
        ns = self.cfg.namespace
        out = JobOutput(on_line)
        lines: queue.Queue = queue.Queue()
        followers: dict[str, threading.Thread] = {}
        started = stopped = None
        state, last_poll, pod_problem, misses = None, 0.0, None, 0
        while True:
            while True:
                try:
                    index, line = lines.get_nowait()
                except queue.Empty:
                    break
                out.feed(index, line)
            now = time.monotonic()
            if now - last_poll >= self.poll_s:
                last_poll = now
                try:
                    pods = core.list_namespaced_pod(ns, label_selector=f"verlflow.io/job={name}").items
                    job = batch.read_namespaced_job_status(name, ns)
                    misses = 0
                except Exception as e:  # noqa: BLE001 - an API blip: the Job goes on; give it a minute
                    misses += 1
                    if misses * self.poll_s > 60:
                        raise KubernetesError(f"lost the API while following {ns}/{name}: {e}") from None
                    continue
                for pod in pods:
                    index = int((pod.metadata.annotations or {}).get(INDEX_KEY)
                                or (pod.metadata.labels or {}).get(INDEX_KEY) or 0)
                    phase = pod.status.phase if pod.status else None
                    if phase in ("Running", "Succeeded", "Failed") and pod.metadata.name not in followers:
                        if started is None and phase == "Running":
                            started = now
                            on_line(f"[k8s] {name}: first pod running {started - t0:.2f} s after create")
                        th = threading.Thread(target=self._stream, args=(core, pod.metadata.name, index, lines),
                                              daemon=True, name=f"log-{pod.metadata.name}")
                        followers[pod.metadata.name] = th
                        th.start()
                    pod_problem = pod_problem or _stuck(pod)
                state = _cond(job)
                if state is not None:
                    break
                if pod_problem and stopped is None:
                    break
            if stopped is None and cancel is not None and cancel.is_set():
                stopped = FailureKind.CANCELLED
            elif stopped is None and spec.timeout_s and started is not None and now - started > spec.timeout_s:
                stopped = FailureKind.TIMEOUT
            if stopped is not None:
                break
            time.sleep(0.05)
        ended = time.monotonic()
        if stopped is None:  # the streams end when the containers do; a failed Job's survivors get little time
            deadline = time.monotonic() + (10 if state == "Complete" else 2)
            for th in followers.values():
                th.join(timeout=max(0.0, deadline - time.monotonic()))
        while not lines.empty():
            out.feed(*lines.get_nowait())
        queued, run_s = (started or ended) - t0, ended - (started or ended)
        on_line(f"[k8s] {name}: {state or (stopped.value if stopped else pod_problem)}: queued {queued:.2f} s, "
                f"ran {run_s:.2f} s")
        where = f"Kubernetes Job {ns}/{name}"
        if stopped is FailureKind.TIMEOUT:
            raise StageFailure(stopped, f"{spec.module} ran past its timeout of {spec.timeout_s:g} s; {where} deleted")
        if stopped is FailureKind.CANCELLED:
            raise StageFailure(stopped, f"{spec.module} was cancelled; {where} deleted")
        if state == "Complete":
            return KubernetesLaunchResult(0, ended - t0, [name], job_name=name, queued_s=queued, run_s=run_s)
        if pod_problem and state is None:
            raise StageFailure(FailureKind.USER_ERROR, f"{where}: a pod cannot start: {pod_problem}")
        if state and state.endswith("DeadlineExceeded"):
            raise StageFailure(FailureKind.TIMEOUT, f"{where} passed activeDeadlineSeconds")
        failure = diagnose_job(spec, out, lambda t: t.errors, 1, where, [])  # the error files the pods printed
        return self._oom_or(failure, core, name)

    def _oom_or(self, failure: StageFailure, core, name) -> StageFailure:
        """A container the kubelet killed for memory (OOMKilled) leaves no error file: say so."""
        if failure.kind not in (FailureKind.KILLED, FailureKind.UNKNOWN):
            raise failure
        pods = core.list_namespaced_pod(self.cfg.namespace, label_selector=f"verlflow.io/job={name}").items
        for pod in pods:
            for cs in (pod.status.container_statuses or []) if pod.status else []:
                term = cs.state.terminated if cs.state else None
                if term is not None and term.reason == "OOMKilled":
                    raise StageFailure(FailureKind.OOM, f"pod {pod.metadata.name} was OOMKilled (raise "
                                       "resources.kubernetes.memory)", exitcode=term.exit_code,
                                       traceback=failure.traceback)
        raise failure

    def _stream(self, core, pod: str, index: int, lines: queue.Queue) -> None:
        try:
            resp = core.read_namespaced_pod_log(pod, self.cfg.namespace, container=CONTAINER, follow=True,
                                                _preload_content=False)
            rest = b""
            for chunk in resp.stream(4096):
                parts = (rest + chunk).split(b"\n")
                rest = parts.pop()
                for p in parts:
                    lines.put((index, p.decode(errors="replace").rstrip("\r")))
            if rest:
                lines.put((index, rest.decode(errors="replace")))
            resp.release_conn()
        except Exception as e:  # noqa: BLE001 - a lost log stream must not fail the stage
            lines.put((index, f"(log stream of {pod} ended: {type(e).__name__}: {e})"))

    def _delete(self, core, batch, name, created, wait: bool) -> None:
        from kubernetes.client.exceptions import ApiException

        ns = self.cfg.namespace
        calls = {"job": lambda: batch.delete_namespaced_job(name, ns, propagation_policy="Foreground"),
                 "service": lambda: core.delete_namespaced_service(name, ns),
                 "configmap": lambda: core.delete_namespaced_config_map(name, ns)}
        for what in ("job", "service", "configmap"):
            if what in created:
                try:
                    calls[what]()
                except ApiException as e:
                    if e.status != 404:
                        raise KubernetesError(f"deleting {what} {ns}/{name}: {e.status} {e.reason}") from None

        def pods_gone() -> bool:
            try:
                return not core.list_namespaced_pod(ns, label_selector=f"verlflow.io/job={name}").items
            except ApiException:
                return True

        if wait:  # foreground deletion: the Job goes once its pods are gone
            wait_until(pods_gone, interval_s=self.poll_s, timeout_s=120)


def _stuck(pod) -> str | None:
    for cs in (pod.status.container_statuses or []) if pod.status else []:
        waiting = cs.state.waiting if cs.state else None
        if waiting is not None and waiting.reason in _STUCK:
            return f"pod {pod.metadata.name}: {waiting.reason}: {waiting.message or ''}".strip()
    return None
