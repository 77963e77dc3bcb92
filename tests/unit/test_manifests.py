"""manifests/ and vagrant/: valid Kubernetes objects, consistent with the code and each other.

No cluster is needed: every document is validated offline against the Kubernetes JSON
schemas (kubernetes-validate, strict: unknown fields fail), and the DaemonSet's command
line is parsed by the agent's own flag parser.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from flannelpy.cli import build_parser
from flannelpy.cni.spec import parse_request
from flannelpy.config.netconf import parse_network_config
from flannelpy.config.settings import settings_from_args

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
MANIFEST = MANIFESTS / "kube-flannelpy.yml"
VAGRANT = ROOT / "vagrant"
# The oldest Kubernetes minor still supported upstream when this was written, and a recent one.
SCHEMA_VERSIONS = ("1.31", "1.34")
ORDER = [
    "Namespace",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "DaemonSet",
]
# Flannel's defaults, exactly as its kube-flannel.yml ships them.
FLANNEL_NET_CONF = {
    "Network": "10.244.0.0/16",
    "EnableNFTables": False,
    "Backend": {"Type": "vxlan"},
}
# What kubelet would substitute for $(VAR) in the agent's args.
FAKE_POD_ENV = {
    "HOST_IP": "192.0.2.10",
    "NODE_NAME": "n1",
    "POD_NAME": "p",
    "POD_NAMESPACE": "kube-flannelpy",
}


def _load(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


DOCS = _load(MANIFEST)


def _one(kind: str) -> dict[str, Any]:
    found = [d for d in DOCS if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _pod() -> dict[str, Any]:
    return _one("DaemonSet")["spec"]["template"]["spec"]


def _agent() -> dict[str, Any]:
    (container,) = _pod()["containers"]
    return container


def _init(name: str) -> dict[str, Any]:
    (container,) = [c for c in _pod()["initContainers"] if c["name"] == name]
    return container


def _host_mounts(container: dict[str, Any]) -> dict[str, str]:
    """mountPath → host path for the container's hostPath volumes."""
    volumes = {v["name"]: v for v in _pod()["volumes"]}
    return {
        m["mountPath"].rstrip("/"): volumes[m["name"]]["hostPath"]["path"]
        for m in container["volumeMounts"]
        if "hostPath" in volumes[m["name"]]
    }


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _expand(text: str, env: dict[str, str]) -> str:
    """kubelet's $(VAR) expansion of command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], text)


def _agent_argv() -> list[str]:
    agent = _agent()
    argv = [*agent["command"], *agent["args"]]
    return [_expand(a, FAKE_POD_ENV) for a in argv]


# --- schema and shape ----------------------------------------------------------------


def _doc_ids() -> Iterator[Any]:
    for version in SCHEMA_VERSIONS:
        for doc in DOCS:
            yield pytest.param(doc, version, id=f"{doc['kind']}-{version}")


@pytest.mark.parametrize(("doc", "version"), list(_doc_ids()))
def test_every_document_validates_against_the_kubernetes_schema(
    doc: dict[str, Any], version: str
) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_rejects_a_misspelt_field() -> None:
    """The check above has teeth: a typo in the DaemonSet fails it."""
    broken = copy.deepcopy(_one("DaemonSet"))
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(broken, SCHEMA_VERSIONS[-1], strict=True)


def test_documents_come_in_dependency_order() -> None:
    assert [d["kind"] for d in DOCS] == ORDER


def test_objects_refer_to_each_other_by_the_right_names() -> None:
    ns = _one("Namespace")["metadata"]["name"]
    sa = _one("ServiceAccount")["metadata"]
    for doc in DOCS:
        if doc["kind"] in ("ServiceAccount", "Role", "RoleBinding", "ConfigMap", "DaemonSet"):
            assert doc["metadata"]["namespace"] == ns, doc["kind"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "flannelpy", doc["kind"]
    for kind in ("ClusterRole", "Role"):
        binding = _one(f"{kind}Binding")
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": kind,
            "name": _one(kind)["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}
        ]
    assert _pod()["serviceAccountName"] == sa["name"]
    (cfg,) = [v for v in _pod()["volumes"] if "configMap" in v]
    assert cfg["configMap"]["name"] == _one("ConfigMap")["metadata"]["name"]


def test_namespace_allows_privileged_pods() -> None:
    labels = _one("Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


# --- RBAC ----------------------------------------------------------------------------


def _normalised(rules: Any) -> list[tuple[str, str, tuple[str, ...]]]:
    return sorted((group, resource, tuple(sorted(verbs))) for group, resource, verbs in rules)


def _granted(kind: str) -> list[tuple[str, str, tuple[str, ...]]]:
    rules = _one(kind)["rules"]
    assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in rules), kind
    return _normalised(
        (group, resource, rule["verbs"])
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    )


def test_cluster_role_grants_exactly_what_the_kubernetes_manager_uses() -> None:
    from flannelpy.store.kube.api import RBAC_RULES

    assert _granted("ClusterRole") == _normalised(RBAC_RULES)
    # Flannel's, plus Events (forced and blocked changes, a repeat patched into the
    # series); nothing else.
    assert _granted("ClusterRole") == [
        ("", "nodes", ("get", "list", "watch")),
        ("", "nodes/status", ("patch",)),
        ("", "pods", ("get",)),
        ("events.k8s.io", "events", ("create", "patch")),
    ]


def test_leases_are_granted_in_the_agents_namespace_only() -> None:
    """Each node's status Lease: a Role in kube-flannelpy, not the ClusterRole (which would
    let an agent rewrite kube-node-lease heartbeats and leader elections anywhere)."""
    from flannelpy.store.kube.api import NAMESPACED_RBAC_RULES
    from flannelpy.store.kube.node_status import DEFAULT_NAMESPACE

    assert _one("Role")["metadata"]["namespace"] == DEFAULT_NAMESPACE
    assert _granted("Role") == _normalised(NAMESPACED_RBAC_RULES)
    assert _granted("Role") == [("coordination.k8s.io", "leases", ("create", "patch"))]
    assert not any(resource == "leases" for _, resource, _ in _granted("ClusterRole"))


# --- ConfigMap -----------------------------------------------------------------------


def test_net_conf_is_flannels_default_and_parses() -> None:
    raw = _one("ConfigMap")["data"]["net-conf.json"]
    assert json.loads(raw) == FLANNEL_NET_CONF
    config = parse_network_config(raw)
    assert str(config.network) == "10.244.0.0/16"
    assert config.backend.type == "vxlan"
    assert not config.backend_defaulted


def test_cni_conf_is_the_repo_conflist_and_parses() -> None:
    raw = _one("ConfigMap")["data"]["cni-conf.json"]
    repo = json.loads((ROOT / "cni_plugin" / "10-flannelpy.conflist").read_text())
    doc = json.loads(raw)
    assert doc == repo
    ours = {**doc["plugins"][0], "cniVersion": doc["cniVersion"], "name": doc["name"]}
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/run/netns/x",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
    }
    assert parse_request(env, json.dumps(ours).encode()).network_name == "cbr0"


# --- DaemonSet -----------------------------------------------------------------------


def test_daemonset_runs_on_every_linux_node_before_it_is_ready() -> None:
    pod = _pod()
    assert pod["hostNetwork"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}
    ]
    ds = _one("DaemonSet")
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_agent_has_the_capabilities_it_needs_and_is_not_privileged() -> None:
    security = _agent()["securityContext"]
    assert security["privileged"] is False
    # SYS_ADMIN: the agent's CNI server setns() into pod network namespaces.
    assert sorted(security["capabilities"]["add"]) == ["NET_ADMIN", "NET_RAW", "SYS_ADMIN"]


def test_agent_resources_are_flannels() -> None:
    assert _agent()["resources"] == {"requests": {"cpu": "100m", "memory": "50Mi"}}


def test_agent_mounts_its_host_paths() -> None:
    mounts = _host_mounts(_agent())
    for path in ("/run/flannel", "/run/flannelpy", "/var/lib/flannelpy", "/run/xtables.lock"):
        assert mounts[path] == path, path
    volumes = {v["name"]: v for v in _pod()["volumes"]}
    (xtables,) = [m for m in _agent()["volumeMounts"] if m["mountPath"] == "/run/xtables.lock"]
    assert volumes[xtables["name"]]["hostPath"]["type"] == "FileOrCreate"
    # The executable passes each pod's namespace as an open fd: no runtime's netns
    # directory is mounted, and the host's PID namespace is not shared.
    assert not [m for m, host in mounts.items() if "netns" in m + host]
    assert _pod().get("hostPID", False) is False


def test_agent_command_line_parses_and_matches_the_mounts() -> None:
    argv = _agent_argv()
    assert argv[0] == "flannelpy"
    assert "flannelpy" in _pyproject()["project"]["scripts"]
    ns = build_parser().parse_args(argv[1:])
    assert ns.command == "agent"
    settings = settings_from_args(ns, {})
    assert settings.kube_subnet_mgr and settings.ip_masq
    assert settings.healthz_port == 8081
    mounts = _host_mounts(_agent())
    assert os.path.dirname(settings.subnet_file) in mounts
    assert settings.state_dir in mounts and settings.run_dir in mounts
    config_dirs = {
        m["mountPath"].rstrip("/") for m in _agent()["volumeMounts"] if m["name"] == "flannel-cfg"
    }
    assert os.path.dirname(settings.net_config_path) in config_dirs
    assert settings.metrics_addr == "192.0.2.10:9403"  # the node address, from $(HOST_IP)


def test_metrics_address_is_the_nodes_address() -> None:
    env = {e["name"]: e for e in _agent()["env"]}
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "--metrics-addr=$(HOST_IP):9403" in _agent()["args"]
    ports = {p["name"]: p["containerPort"] for p in _agent()["ports"]}
    assert ports == {"healthz": 8081, "metrics": 9403}


def test_probes_use_the_health_port() -> None:
    agent = _agent()
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "healthz"}


def test_init_containers_install_the_cni_executable_and_conflist() -> None:
    plugin = _init("install-cni-plugin")
    script = "\n".join(plugin["args"])
    assert "/opt/flannelpy/flannelpy-cni" in script
    assert re.search(r"mv -f \S+ /opt/cni/bin/flannelpy\n", script)
    assert _host_mounts(plugin) == {"/opt/cni/bin": "/opt/cni/bin"}
    # The executable's name is the conflist's plugin type: that is what kubelet runs.
    conflist = json.loads(_one("ConfigMap")["data"]["cni-conf.json"])
    assert conflist["plugins"][0]["type"] == "flannelpy"

    # The conflist: checked and renamed into place (tests/unit/test_install_cni.py runs it).
    conf = _init("install-cni")
    assert conf["command"] == ["flannelpy", "install-cni-conf"]
    assert conf["args"][:2] == [
        "/etc/kube-flannel/cni-conf.json",
        "/etc/cni/net.d/10-flannelpy.conflist",
    ]
    assert _host_mounts(conf) == {"/etc/cni/net.d": "/etc/cni/net.d"}


def test_init_scripts_are_valid_shell() -> None:
    container = _init("install-cni-plugin")
    assert container["command"] == ["/bin/sh", "-c"]
    (script,) = container["args"]
    subprocess.run(["sh", "-n", "-c", script], check=True)


def test_all_containers_run_the_released_image() -> None:
    version = _pyproject()["project"]["version"]
    pod = _pod()
    images = {c["image"] for c in [*pod["initContainers"], *pod["containers"]]}
    assert images == {f"flannelpy:{version}"}
    labels = _one("DaemonSet")["metadata"]["labels"]
    assert labels["app.kubernetes.io/version"] == version


# --- kustomization and Dockerfile ----------------------------------------------------


def _needs_operator_crds(path: Path) -> bool:
    """Whether applying the file needs the Prometheus Operator's CRDs."""
    return any(d["apiVersion"].startswith("monitoring.coreos.com/") for d in _load(path))


def test_kustomization_lists_every_manifest_a_plain_cluster_accepts() -> None:
    """`kubectl apply -k manifests` must work on a fresh cluster (kind, kubeadm): files
    with Prometheus Operator objects stay out of it and are applied with -f once the
    operator is installed (manifests/README.md says so)."""
    (kust,) = _load(MANIFESTS / "kustomization.yaml")
    assert kust["kind"] == "Kustomization"
    listed = list(kust["resources"])
    assert listed[0] == MANIFEST.name
    on_disk = {p.name for p in MANIFESTS.iterdir() if p.suffix in (".yml", ".yaml")}
    on_disk.discard("kustomization.yaml")
    operator_only = {name for name in on_disk if _needs_operator_crds(MANIFESTS / name)}
    assert set(listed) == on_disk - operator_only
    readme = (MANIFESTS / "README.md").read_text()
    for name in operator_only:
        assert f"kubectl apply -f manifests/{name}" in readme, name


def test_metrics_service_selects_the_agents_metrics_port() -> None:
    (service,) = [d for d in _load(MANIFESTS / "servicemonitor.yaml") if d["kind"] == "Service"]
    kubernetes_validate.validate(service, SCHEMA_VERSIONS[-1], strict=True)
    assert service["metadata"]["namespace"] == _one("Namespace")["metadata"]["name"]
    pod_labels = _one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for p in _agent()["ports"]}
    (port,) = service["spec"]["ports"]
    assert ports[port["targetPort"]] == port["port"] == 9403


def test_dockerfile_builds_what_the_manifests_use() -> None:
    text = (MANIFESTS / "Dockerfile").read_text()
    # The CNI executable: built by scripts/build-cni.sh, copied where the init container looks.
    assert "scripts/build-cni.sh" in text
    assert re.search(
        r"COPY --from=\S+ \S*build/flannelpy-cni \S*/opt/flannelpy/flannelpy-cni", text
    )
    assert "build/flannelpy-cni" in (ROOT / "scripts" / "build-cni.sh").read_text()
    # What the agent shells out to (tests/unit/test_image.py has the whole list), and the
    # transport of its Kubernetes client, a dependency the lock's runtime section holds
    # (tests/unit/test_dependency_lock.py).
    assert re.search(r'ARG PACKAGES="[^"]*\biproute2\b[^"]*\biptables\b[^"]*\bnftables\b', text)
    assert re.search(r"pip install [^\n]*--require-hashes -r runtime\.lock", text)
    assert any(d.startswith("urllib3") for d in _pyproject()["project"]["dependencies"])
    # Every path the image copies from exists in the repo.
    for src in re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.M):
        assert (ROOT / src).exists(), src


# --- test clusters -------------------------------------------------------------------


def test_test_clusters_use_the_manifests_network() -> None:
    network = FLANNEL_NET_CONF["Network"]
    kind = yaml.safe_load((VAGRANT / "kind-config.yaml").read_text())
    assert kind["networking"] == {"disableDefaultCNI": True, "podSubnet": network}
    assert [n["role"] for n in kind["nodes"]] == ["control-plane", "worker", "worker"]
    vagrantfile = (VAGRANT / "Vagrantfile").read_text()
    assert f'POD_CIDR = "{network}"' in vagrantfile
    assert "--pod-network-cidr=#{POD_CIDR}" in vagrantfile
    version = _pyproject()["project"]["version"]
    assert f'IMAGE = "docker.io/library/flannelpy:{version}"' in vagrantfile
    assert f"IMAGE=${{IMAGE:-flannelpy:{version}}}" in (VAGRANT / "kind-up.sh").read_text()


@pytest.mark.parametrize("script", ["kind-up.sh", "smoke-test.sh"])
def test_cluster_scripts_are_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", str(VAGRANT / script)], check=True)


# --- NetworkPolicy, a kustomize component ------------------------------------------------

POLICY_COMPONENT = MANIFESTS / "network-policy"


def test_the_network_policy_component_grants_exactly_what_its_watches_use() -> None:
    from flannelpy.store.kube.policy_watch import POLICY_RBAC_RULES

    (kust,) = _load(POLICY_COMPONENT / "kustomization.yaml")
    assert kust["kind"] == "Component"
    docs = [d for name in kust["resources"] for d in _load(POLICY_COMPONENT / name)]
    for doc in docs:
        kubernetes_validate.validate(doc, SCHEMA_VERSIONS[-1], strict=True)
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    granted = _normalised(
        (group, resource, rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    )
    assert granted == _normalised(POLICY_RBAC_RULES)
    assert (
        binding["roleRef"]["name"]
        == role["metadata"]["name"]
        != _one("ClusterRole")["metadata"]["name"]
    )
    assert binding["subjects"] == _one("ClusterRoleBinding")["subjects"]


def test_the_network_policy_component_turns_the_flag_on_in_the_daemonset() -> None:
    (kust,) = _load(POLICY_COMPONENT / "kustomization.yaml")
    (patch,) = [d for p in kust["patches"] for d in _load(POLICY_COMPONENT / p["path"])]
    daemonset = _one("DaemonSet")
    assert patch["metadata"] == {
        "name": daemonset["metadata"]["name"],
        "namespace": daemonset["metadata"]["namespace"],
    }
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    agent = _agent()
    assert container["name"] == agent["name"]
    env = {e["name"]: e["value"] for e in container["env"]}
    ns = build_parser().parse_args(_agent_argv()[1:])
    assert settings_from_args(ns, {**FAKE_POD_ENV, **env}).enable_network_policy
