"""deploy/ and docker/: the manifests validate offline, name only settings hsx reads, and
the Grafana board queries only metrics the coordinator exports.

What the manifests promise a team sharing the service is checked too: Ray's ports take
connections only from the cluster's own pods and the coordinator's port only from the
sources named, every container runs as the same non-root user without privilege
escalation on a read-only root, the bucket Secret reaches only the containers that use
it, and the coordinator cannot start without its token, nor with the example's.

Kubernetes objects are checked with kubernetes-validate (Kubernetes' own JSON schemas,
shipped in its wheel: no network) in strict mode, which refuses unknown fields as
`kubectl apply` with strict field validation does. The RayCluster is checked against
deploy/schemas/raycluster.ray.io-v1.schema.json (KubeRay's ray.io/v1 fields) and its pod
templates against Kubernetes' PodTemplateSpec; where a copy of KubeRay's own CRD is at
hand (HSX_KUBERAY_CRD, or shared/kuberay/ray.io_rayclusters.yaml beside the checkout),
against that too.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from hsx.output.local_storage import OUTPUT_MODE_ENV
from hsx.spec import JobSpec
from hsx_service.config import Settings
from hsx_service.errors import JobRefused
from hsx_service.main import create_app
from hsx_service.metrics import METRICS, exposed_names
from hsx_service.paths import Roots, check_job_paths
from hsx_service.users import TokenTable

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BOARD = DEPLOY / "grafana" / "hsx-dashboard.json"
RAYCLUSTER_SCHEMA = DEPLOY / "schemas" / "raycluster.ray.io-v1.schema.json"
# Kubernetes minor versions checked: an older one still widely run, and the newest.
KUBERNETES = ("1.28", "1.33")
# What the object-store client reads for s3:// outputs (the AWS SDKs' names).
OBJECT_STORE_ENV = {
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
    "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP",
}

# Read by the processes themselves: where a user without an entry in the image's passwd
# keeps its caches, and the name getpass gives it.
PROCESS_ENV = {"HOME", "USER"}
# Ray's own ports on the head (the container's named ports) and the component labels of
# the pods that make up the service.
RAY_COMPONENTS = {"ray-head", "ray-worker"}
SERVICE_COMPONENTS = RAY_COMPONENTS | {"coordinator"}
COMPONENT = "app.kubernetes.io/component"

kubernetes_validate = pytest.importorskip("kubernetes_validate")


def documents() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) of every manifest in deploy/."""
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def validate_raycluster(doc: dict[str, Any], version: str) -> None:
    """KubeRay's fields (our schema), then each pod template against Kubernetes'."""
    schema = json.loads(RAYCLUSTER_SCHEMA.read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)
    groups = [doc["spec"]["headGroupSpec"], *doc["spec"].get("workerGroupSpecs", [])]
    for group in groups:
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
             "template": group["template"]}, version, strict=True)


def validate(doc: dict[str, Any], version: str) -> None:
    if doc["kind"] == "RayCluster":
        validate_raycluster(doc, version)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES)
def test_manifests_validate(version: str) -> None:
    docs = documents()
    assert {doc["kind"] for _, doc in docs} >= {
        "RayCluster", "Deployment", "Service", "PersistentVolumeClaim", "Secret",
        "NetworkPolicy"}
    for name, doc in docs:
        try:
            validate(doc, version)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as err:
            pytest.fail(f"{name} {doc['kind']}/{doc['metadata']['name']}: {err.message}")


def _broken(kind: str, change: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(by_kind(kind)[0]))
    change(doc)
    return doc


@pytest.mark.parametrize(
    ("kind", "change"),
    [
        ("Deployment", lambda d: d["spec"].update(replica=1)),
        ("Deployment", lambda d: d["spec"].update(replicas="one")),
        ("Deployment",
         lambda d: d["spec"]["template"]["spec"]["containers"][0].update(livenesProbe={})),
        ("Service", lambda d: d["spec"]["ports"][0].update(port="http")),
        ("RayCluster", lambda d: d["spec"].update(workerGroupSpec=[])),
        ("RayCluster", lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].update(port=6379)),
        ("RayCluster", lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName")),
        ("RayCluster", lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]
         ["containers"][0].update(imagePullPolicy=3)),
    ],
    ids=["unknown-field", "wrong-type", "misspelt-probe", "port-name", "ray-unknown-field",
         "ray-start-param-not-a-string", "ray-missing-group-name", "ray-pod-template"],
)
def test_mistakes_are_caught(kind: str, change: Any) -> None:
    """The checks are not vacuous: a typical mistake in each kind fails them."""
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(_broken(kind, change), KUBERNETES[-1])


def _upstream_crd() -> Path | None:
    given = os.environ.get("HSX_KUBERAY_CRD")
    candidates = [Path(given)] if given else []
    candidates.append(ROOT.parent / "shared" / "kuberay" / "ray.io_rayclusters.yaml")
    return next((p for p in candidates if p.is_file()), None)


def test_raycluster_against_kuberays_own_crd() -> None:
    crd_path = _upstream_crd()
    if crd_path is None:
        pytest.skip("no copy of KubeRay's CRD (HSX_KUBERAY_CRD or shared/kuberay/)")
    crd = yaml.safe_load(crd_path.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = version["schema"]["openAPIV3Schema"]
    for doc in by_kind("RayCluster"):
        jsonschema.Draft7Validator(schema).validate(doc)


# ----------------------------------------------------------------------- what they name


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "RayCluster":
        groups = [doc["spec"]["headGroupSpec"], *doc["spec"].get("workerGroupSpecs", [])]
        return [c for g in groups for c in g["template"]["spec"]["containers"]]
    if doc["kind"] == "Deployment":
        return list(doc["spec"]["template"]["spec"]["containers"])
    return []


def _secrets() -> dict[str, set[str]]:
    return {doc["metadata"]["name"]: set(doc["stringData"]) for doc in by_kind("Secret")}


def _env_names(container: dict[str, Any]) -> set[str]:
    """Variables the container gets: its env, and the keys of the Secrets it takes whole."""
    names = {e["name"] for e in container.get("env", [])}
    for source in container.get("envFrom", []):
        names |= _secrets()[source["secretRef"]["name"]]
    return names


def test_env_names_are_settings_hsx_reads() -> None:
    # The coordinator's settings, and what the output layer reads in every process.
    settings = {f"HSX_{name.upper()}" for name in Settings.model_fields} | {OUTPUT_MODE_ENV}
    for _, doc in documents():
        for container in _containers(doc):
            for name in _env_names(container):
                if name.startswith("HSX_"):
                    assert name in settings, f"{container['name']}: {name} is no setting"
                elif name not in PROCESS_ENV:
                    assert name in OBJECT_STORE_ENV, f"{container['name']}: nobody reads {name}"
    # The coordinator's literal values parse as its settings do.
    (deployment,) = by_kind("Deployment")
    (coordinator,) = _containers(deployment)
    literal = {e["name"]: e["value"] for e in coordinator["env"] if "value" in e}
    parsed = Settings(**{k.removeprefix("HSX_").lower(): v for k, v in literal.items()})
    assert parsed.host == "0.0.0.0" and parsed.exposed
    assert parsed.ray_address is not None and parsed.allowed_roots


def test_secrets_and_volumes_referenced_exist() -> None:
    secrets = _secrets()
    (deployment,) = by_kind("Deployment")
    (coordinator,) = _containers(deployment)
    token = next(e for e in coordinator["env"] if e["name"] == "HSX_API_TOKEN")
    ref = token["valueFrom"]["secretKeyRef"]
    assert ref["key"] in secrets[ref["name"]]
    bucket = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"}
    assert bucket <= secrets["hsx-bucket"]
    claims = {doc["metadata"]["name"] for doc in by_kind("PersistentVolumeClaim")}
    for _, doc in documents():
        pods = ([doc["spec"]["template"]["spec"]] if doc["kind"] == "Deployment" else
                [g["template"]["spec"] for g in [doc["spec"]["headGroupSpec"],
                                                 *doc["spec"].get("workerGroupSpecs", [])]]
                if doc["kind"] == "RayCluster" else [])
        for pod in pods:
            for volume in pod.get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    assert volume["persistentVolumeClaim"]["claimName"] in claims


def test_coordinator_wiring() -> None:
    """Probes hit the app's real routes; the Service reaches the pod; the Ray address is
    the head service KubeRay makes for the RayCluster, on its client port."""
    (deployment,) = by_kind("Deployment")
    (service,) = by_kind("Service")
    (cluster,) = by_kind("RayCluster")
    pod = deployment["spec"]["template"]
    (coordinator,) = pod["spec"]["containers"]
    routes = {getattr(r, "path", None) for r in create_app(Settings()).routes}
    assert coordinator["livenessProbe"]["httpGet"]["path"] == "/healthz" in routes
    assert coordinator["readinessProbe"]["httpGet"]["path"] == "/readyz" in routes
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics" in routes
    ports = {p["name"]: p["containerPort"] for p in coordinator["ports"]}
    env = {e["name"]: e.get("value") for e in coordinator["env"]}
    assert ports["http"] == int(env["HSX_PORT"]) == service["spec"]["ports"][0]["port"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # one ledger writer
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    client_port = next(p["containerPort"] for p in head["ports"] if p["name"] == "client")
    assert env["HSX_RAY_ADDRESS"] == f"ray://{cluster['metadata']['name']}-head-svc:{client_port}"
    ledger_mount = next(m for m in coordinator["volumeMounts"] if m["name"] == "ledger")
    assert Path(env["HSX_LEDGER_PATH"]).parent == Path(ledger_mount["mountPath"])


def test_the_shipped_roots_take_the_volume_and_the_bucket() -> None:
    """The coordinator as shipped accepts a job writing to its bucket (the Secret the
    manifests mount is for one) and to the shared volume, and nothing else."""
    (deployment,) = by_kind("Deployment")
    (coordinator,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in coordinator["env"]}
    roots = Settings(allowed_roots=env["HSX_ALLOWED_ROOTS"]).effective_roots()
    assert roots is not None
    mounts = {m["mountPath"] for m in coordinator["volumeMounts"]}
    assert any(str(r) in mounts for r in roots)
    buckets = [str(r) for r in roots if str(r).startswith("s3://")]
    assert buckets, roots

    def job(output: str) -> JobSpec:
        return JobSpec(model="m", dataset="/output/chats.jsonl", output=output)

    check_job_paths(job(f"{buckets[0]}/jobs/chat-8b"), Roots(tuple(roots)))
    check_job_paths(job("/output/chat-8b"), Roots(tuple(roots)))
    for outside in ("s3://another-bucket/x", "/etc/x"):
        with pytest.raises(JobRefused, match="output"):
            check_job_paths(job(outside), Roots(tuple(roots)))


# ----------------------------------------------------------------------- a shared service


def _pods(docs: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Each pod template of the service by its component label."""
    docs = docs if docs is not None else [doc for _, doc in documents()]
    out = {}
    for doc in docs:
        if doc["kind"] == "RayCluster":
            groups = [doc["spec"]["headGroupSpec"], *doc["spec"].get("workerGroupSpecs", [])]
            templates = [g["template"] for g in groups]
        elif doc["kind"] == "Deployment":
            templates = [doc["spec"]["template"]]
        else:
            continue
        for template in templates:
            out[template["metadata"]["labels"][COMPONENT]] = template
    return out


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector selects a pod with these labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _peer_components(peer: dict[str, Any]) -> set[str] | None:
    """The service's components a `from` peer admits, or None when it admits pods that
    are none of them (another namespace, an address range, any pod)."""
    selector = peer.get("podSelector")
    if set(peer) != {"podSelector"} or selector is None:
        return None
    for stranger in ({}, {"app.kubernetes.io/name": "other"},
                     {"app.kubernetes.io/name": "hsx"},
                     {"app.kubernetes.io/name": "hsx", COMPONENT: "other"}):
        if _matches(selector, stranger):
            return None
    return {c for c in SERVICE_COMPONENTS
            if _matches(selector, {"app.kubernetes.io/name": "hsx", COMPONENT: c})}


def _ingress(docs: list[dict[str, Any]], component: str) -> list[dict[str, Any]] | None:
    """The ingress rules of the policies that select the component's pods; None when no
    policy isolates them (every connection allowed)."""
    labels = _pods(docs)[component]["metadata"]["labels"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"
                and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
                and _matches(d["spec"]["podSelector"], labels)]
    if not policies:
        return None
    return [rule for p in policies for rule in p["spec"].get("ingress", [])]


def ray_exposure(docs: list[dict[str, Any]]) -> list[str]:
    """Who besides the service's own pods may connect to a Ray pod (empty: nobody)."""
    problems = []
    for component in sorted(RAY_COMPONENTS):
        rules = _ingress(docs, component)
        if rules is None:
            problems.append(f"{component}: no NetworkPolicy selects it")
            continue
        for rule in rules:
            peers = rule.get("from") or [{}]  # no `from`: from everywhere
            for peer in peers:
                admitted = _peer_components(peer)
                if admitted is None or not admitted:
                    problems.append(f"{component}: a rule admits {peer or 'anyone'}")
    return problems


def _reaches(docs: list[dict[str, Any]], source: str, target: str, port: int) -> bool:
    rules = _ingress(docs, target) or []
    for rule in rules:
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        if any(source in (_peer_components(peer) or set()) for peer in rule.get("from", [])):
            return True
    return False


def _head_ports() -> dict[str, int]:
    (cluster,) = by_kind("RayCluster")
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in head["ports"]}


def test_rays_ports_take_only_the_services_own_pods() -> None:
    docs = [doc for _, doc in documents()]
    assert ray_exposure(docs) == []
    ports = _head_ports()
    assert set(ports) == {"gcs", "dashboard", "client"}
    for port in ports.values():  # GCS, dashboard and job API, client
        assert _reaches(docs, "ray-worker", "ray-head", port)
    assert _reaches(docs, "ray-head", "ray-worker", 6379)
    # The coordinator joins through the client port, and reaches no other.
    assert _reaches(docs, "coordinator", "ray-head", ports["client"])
    assert not _reaches(docs, "coordinator", "ray-head", ports["dashboard"])
    assert not _reaches(docs, "coordinator", "ray-head", ports["gcs"])


@pytest.mark.parametrize("change", [
    lambda p: p.clear(),  # no policy at all
    lambda p: p[0]["spec"]["ingress"][0].pop("from"),  # from everywhere
    lambda p: p[0]["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}}),
    lambda p: p[0]["spec"]["ingress"][0]["from"][0]["podSelector"].pop("matchExpressions"),
    lambda p: p[0]["spec"]["ingress"].append({"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}),
], ids=["no-policy", "no-from", "any-namespace", "any-hsx-pod", "any-address"])
def test_an_exposed_ray_port_is_caught(change: Any) -> None:
    docs = json.loads(json.dumps([doc for _, doc in documents()]))
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"
                and d["metadata"]["name"] == "hsx-ray"]
    change(policies)
    if not policies:
        docs = [d for d in docs if d["kind"] != "NetworkPolicy"]
    assert ray_exposure(docs)


def test_the_coordinators_port_takes_only_the_sources_named() -> None:
    docs = [doc for _, doc in documents()]
    rules = _ingress(docs, "coordinator")
    assert rules, "no NetworkPolicy selects the coordinator"
    (deployment,) = by_kind("Deployment")
    (coordinator,) = _containers(deployment)
    port = int(next(e["value"] for e in coordinator["env"] if e["name"] == "HSX_PORT"))
    for rule in rules:
        assert [p["port"] for p in rule.get("ports", [])] == [port], rule
        assert rule.get("from"), "a rule without `from` admits anyone"
    for component in RAY_COMPONENTS:  # the jobs' code runs there
        assert not _reaches(docs, component, "coordinator", port)


def test_every_container_runs_as_the_same_user_without_privileges() -> None:
    users = set()
    for component, template in _pods().items():
        pod = template["spec"]
        assert pod.get("automountServiceAccountToken") is False, component
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            where = f"{component}/{container['name']}"
            context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
            assert context.get("runAsNonRoot") is True, where
            assert context.get("runAsUser", 0) != 0, where
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not context.get("privileged"), where
            assert context.get("readOnlyRootFilesystem") is True, where
            users.add((context["runAsUser"], context.get("runAsGroup")))
            # What Ray, vLLM and the caches write, on a read-only root: emptyDirs.
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            home = next(e["value"] for e in container["env"] if e["name"] == "HOME")
            for path in ("/tmp", home):
                assert "emptyDir" in volumes[mounts[path]], f"{where}: {path} is not writable"
    # One user everywhere: outputs are owner-only (HSX_OUTPUT_MODE), and the coordinator
    # and the trainer read what the engines wrote.
    assert len(users) == 1, users


def _secret_users() -> dict[str, set[str]]:
    """Each Secret by the containers that get it (env, envFrom or a mounted volume)."""
    out: dict[str, set[str]] = {}
    for component, template in _pods().items():
        pod = template["spec"]
        secret_volumes = {v["name"]: v["secret"]["secretName"]
                          for v in pod.get("volumes", []) if "secret" in v}
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            where = f"{component}/{container['name']}"
            names = {s["secretRef"]["name"] for s in container.get("envFrom", [])
                     if "secretRef" in s}
            names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                      if "secretKeyRef" in e.get("valueFrom", {})}
            names |= {secret_volumes[m["name"]] for m in container.get("volumeMounts", [])
                      if m["name"] in secret_volumes}
            for name in names:
                out.setdefault(name, set()).add(where)
    return out


def test_secrets_reach_only_the_containers_that_use_them() -> None:
    users = _secret_users()
    # The coordinator writes and reads bucket outputs and resolves the credentials it
    # hands to a job's actors; the workers' engines and trainer write shards and drafts.
    # The head runs Ray's control plane: no bucket keys there.
    assert users["hsx-bucket"] == {"coordinator/coordinator", "ray-worker/ray-worker"}
    assert users["hsx-api-token"] == {"coordinator/coordinator"}
    assert set(users) <= set(_secrets())


def test_the_coordinator_never_serves_open() -> None:
    (deployment,) = by_kind("Deployment")
    (coordinator,) = _containers(deployment)
    env = {e["name"]: e for e in coordinator["env"]}
    assert "HSX_ALLOW_OPEN" not in env
    token = env["HSX_API_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token.get("optional", False) is False  # no Secret, no pod
    literal = {k.removeprefix("HSX_").lower(): e["value"] for k, e in env.items()
               if k.startswith("HSX_") and "value" in e}
    assert Settings(**literal, api_token="t").refusal_to_start() is None
    # Were the token missing after all, the exposed coordinator would not start.
    assert Settings(**literal).refusal_to_start() is not None


def test_the_example_secret_cannot_be_used_as_it_is() -> None:
    """secrets.example.yaml validates (a copy with real values is applied), but the
    coordinator refuses to start with its placeholder token, naming it."""
    (example,) = [doc for name, doc in documents()
                  if name == "secrets.example.yaml" and doc["metadata"]["name"] == "hsx-api-token"]
    placeholder = example["stringData"]["HSX_API_TOKEN"]
    with pytest.raises(ValueError, match=r"^HSX_API_TOKEN .* is an example's placeholder"):
        TokenTable.load(Settings(api_token=placeholder))
    TokenTable.load(Settings(api_token="6f1c0e3a9b7d4c2e8f5a1b0c9d8e7f6a"))


# ----------------------------------------------------------------------- the Grafana board


def board_metric_names(board: dict[str, Any] | None = None) -> set[str]:
    """Every metric name the board's queries (panels and variables) use."""
    board = board if board is not None else json.loads(BOARD.read_text())
    text = json.dumps([board["panels"], board["templating"]])
    return set(re.findall(r"\bhsx_[a-z0-9_]+", text))


def test_grafana_board_is_built_on_the_exported_names() -> None:
    board = json.loads(BOARD.read_text())
    names = board_metric_names(board)
    assert names <= exposed_names(), f"the board queries unknown metrics: {names - exposed_names()}"
    families = {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                if n.startswith("hsx_unit_seconds") else n for n in names}
    assert families == set(METRICS), f"exported but not on the board: {set(METRICS) - families}"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_images_install_hsx() -> None:
    for name in ("Dockerfile.cpu", "Dockerfile.gpu"):
        text = (ROOT / "docker" / name).read_text()
        assert "client" in text and "workers" in text and "service" in text
