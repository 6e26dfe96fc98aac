"""The Kubernetes manifests and the nginx configuration: valid, and consistent with the service
(probe paths, metric names, limits and grace periods match what the service really does)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from conftest import REPO
from jsonschema import Draft202012Validator

K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.31"


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def kustomize_resources(directory: Path) -> list[dict]:
    """What ``kustomize build`` would start from: every resource, overlays resolved."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    found = []
    for entry in kustomization["resources"]:
        target = (directory / entry).resolve()
        assert target.exists(), f"{directory}/kustomization.yaml names missing {entry}"
        found += kustomize_resources(target) if target.is_dir() else documents(target)
    return found


@pytest.mark.parametrize("overlay", ["base", "hpa", "keda"])
def test_every_manifest_validates(overlay):
    schema = json.loads((K8S / "schemas" / "scaledobject.schema.json").read_text())
    resources = kustomize_resources(K8S / overlay)
    assert resources
    for doc in resources:
        if doc["kind"] == "ScaledObject":
            errors = list(Draft202012Validator(schema).iter_errors(doc))
            assert not errors, [e.message for e in errors]
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_an_invalid_manifest_is_caught():
    deployment = documents(K8S / "base" / "deployment.yaml")[0]
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    scaled = documents(K8S / "keda" / "scaledobject.yaml")[0]
    scaled["spec"]["triggers"][0].pop("metadata")
    schema = json.loads((K8S / "schemas" / "scaledobject.schema.json").read_text())
    assert list(Draft202012Validator(schema).iter_errors(scaled))


def by_kind(overlay: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in kustomize_resources(K8S / overlay)}


def test_deployment_matches_the_service_and_the_compose_file():
    from chattts_service.config import Settings

    deployment = by_kind("base")["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # a first start downloads the model: at least 20 minutes before the startup probe gives up
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["CHATTTS_DOWNLOAD"] == "auto" and "initContainers" not in pod
    # preStop + drain + in-flight grace fit inside the termination grace period
    settings = Settings.from_env({})
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > (
        pre_stop + settings.drain_seconds + settings.graceful_timeout_s
    )
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["chattts"]
    limits = compose["deploy"]["resources"]["limits"]
    assert container["resources"]["limits"]["memory"] == limits["memory"] + "i"
    assert float(container["resources"]["limits"]["cpu"].rstrip("m")) / 1000 == float(
        limits["cpus"]
    )
    env = {item["name"]: item.get("value") for item in container["env"]}
    for name in env:
        if name.startswith("CHATTTS_"):
            assert name in {variable for variable, *_ in Settings.documentation()}, name
    assert (
        deployment["spec"]["selector"]["matchLabels"]
        == by_kind("base")["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    )


def test_keda_scales_on_a_metric_the_service_exports():
    from chattts_service.runtime.metrics import Metrics

    query = by_kind("keda")["ScaledObject"]["spec"]["triggers"][0]["metadata"]["query"]
    names = {metric.name for metric in Metrics().registry.collect()}
    used = re.findall(r"(chatts_[a-z_]+)", query)
    assert used and all(name in names for name in used), (used, sorted(names))
    assert "HorizontalPodAutoscaler" not in by_kind("keda")  # KEDA owns its HPA


def test_nginx_configuration_is_valid(tmp_path):
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    config = (REPO / "deploy" / "nginx" / "chattts.conf").read_text()
    # the compose service names resolve only inside compose; the syntax check needs addresses
    config = (
        config.replace("chattts-1:8090", "127.0.0.1:18091")
        .replace("chattts-2:8090", "127.0.0.1:18092")
        .replace("listen 8090", "listen 127.0.0.1:18090")
    )
    (tmp_path / "chattts.conf").write_text(config)
    (tmp_path / "nginx.conf").write_text(
        f"pid {tmp_path}/nginx.pid; error_log {tmp_path}/error.log;\n"
        "events {}\nhttp { access_log off; include chattts.conf; }\n"
    )
    result = subprocess.run(
        [nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
