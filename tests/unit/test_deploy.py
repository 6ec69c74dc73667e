"""The deploy manifests and images at least parse and name what they need."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_raycluster_manifest_parses() -> None:
    doc = yaml.safe_load((ROOT / "deploy" / "raycluster.yaml").read_text())
    assert doc["kind"] == "RayCluster"
    workers = doc["spec"]["workerGroupSpecs"]
    assert any("nvidia.com/gpu" in str(group) for group in workers)


def test_images_install_hsx() -> None:
    for name in ("Dockerfile.cpu", "Dockerfile.gpu"):
        text = (ROOT / "docker" / name).read_text()
        assert "client" in text and "workers" in text and "service" in text
