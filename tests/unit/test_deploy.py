"""deploy/ and docker/: the manifests validate offline, name only settings hsx reads, and
the Grafana board queries only metrics the coordinator exports.

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

from hsx.spec import JobSpec
from hsx_service.config import Settings
from hsx_service.errors import JobRefused
from hsx_service.main import create_app
from hsx_service.metrics import METRICS, exposed_names
from hsx_service.paths import check_job_paths

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
        "RayCluster", "Deployment", "Service", "PersistentVolumeClaim", "Secret"}
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
    settings = {f"HSX_{name.upper()}" for name in Settings.model_fields}
    for _, doc in documents():
        for container in _containers(doc):
            for name in _env_names(container):
                if name.startswith("HSX_"):
                    assert name in settings, f"{container['name']}: {name} is no setting"
                else:
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

    check_job_paths(job(f"{buckets[0]}/jobs/chat-8b"), roots)
    check_job_paths(job("/output/chat-8b"), roots)
    for outside in ("s3://another-bucket/x", "/etc/x"):
        with pytest.raises(JobRefused, match="output"):
            check_job_paths(job(outside), roots)


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
