"""Every file under deploy/ parses, and says what the deployment needs: the Kubernetes pod shares
the socket directory and a sized memory-backed /dev/shm between engine and sidecar, probes
/status, runs non-root; the systemd unit has RuntimeDirectory=, LimitMEMLOCK= and hardening that
keeps /dev/shm shared; the kvcached command lines in them are ones the CLI accepts."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from kvcached.cli import build_parser
from kvcached.config import DaemonConfig, parse_http_address

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(REPO_ROOT, "deploy")
K8S_MANIFEST = os.path.join(DEPLOY, "k8s", "engine-with-kvcached.yaml")
UNIT = os.path.join(DEPLOY, "systemd", "kvcached.service")
ENGINE_DROP_IN = os.path.join(DEPLOY, "systemd", "kvcached-engine.conf")
DOCKERFILE_INSTRUCTIONS = {"FROM", "WORKDIR", "COPY", "ADD", "RUN", "ENV", "USER", "STOPSIGNAL", "ENTRYPOINT", "CMD",
                           "EXPOSE", "LABEL", "ARG", "VOLUME", "HEALTHCHECK", "SHELL", "ONBUILD"}


def parse_unit(path: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file: section -> key -> every value given (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("[") and line.endswith("]"):
                current = sections.setdefault(line[1:-1], {})
                continue
            key, sep, value = line.partition("=")
            assert current is not None and sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key), f"{path}:{number}: {line}"
            current.setdefault(key, []).append(value)
    return sections


def parse_containerfile(path: str) -> list[tuple[str, str]]:
    instructions = []
    with open(path) as f:
        text = f.read().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            assert word in DOCKERFILE_INSTRUCTIONS, f"{path}: unknown instruction {word}"
            instructions.append((word, rest.strip()))
    return instructions


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes quantity (binary suffixes) in bytes."""
    match = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|Ti)?", quantity)
    assert match, quantity
    return int(match.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[match.group(2)]


def serve_config(args: list[str], env: dict[str, str]) -> DaemonConfig:
    """The DaemonConfig `kvcached ARGS` would run with under env (the CLI's own parser)."""
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve"
    return DaemonConfig.from_env(env, **{field: getattr(parsed, field) for field in parsed.flags})


def test_every_file_under_deploy_parses():
    """Each file under deploy/ is parsed by the parser of its kind (YAML, JSON, systemd unit,
    Containerfile, Markdown read as text); no file is of a kind the test does not know."""
    seen = 0
    for directory, _, names in os.walk(DEPLOY):
        for name in names:
            path = os.path.join(directory, name)
            if name.endswith((".yaml", ".yml")):
                assert [doc for doc in yaml.safe_load_all(open(path)) if doc is not None], path
            elif name.endswith(".json"):
                json.load(open(path))
            elif name.endswith((".service", ".conf")):
                assert parse_unit(path), path
            elif name == "Containerfile":
                assert parse_containerfile(path), path
            elif name.endswith(".md"):
                assert open(path).read().strip(), path
            else:
                raise AssertionError(f"{path}: a file of a kind no test parses")
            seen += 1
    assert seen >= 7


def test_containerfile_copies_what_exists():
    """The container image copies only paths of this repository and installs the package."""
    instructions = parse_containerfile(os.path.join(DEPLOY, "container", "Containerfile"))
    for word, rest in instructions:
        if word == "COPY":
            for source in rest.split()[:-1]:
                assert os.path.exists(os.path.join(REPO_ROOT, source)), source
    assert any(word == "RUN" and "pip install" in rest for word, rest in instructions)


def _pod() -> tuple[dict, dict, dict, dict]:
    docs = list(yaml.safe_load_all(open(K8S_MANIFEST)))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    containers = pod["containers"] + pod.get("initContainers", [])
    sidecar = next(c for c in containers if c["name"] == "kvcached")
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    return docs, pod, sidecar, engine


def _mounts(container: dict) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container["volumeMounts"]}


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def test_k8s_pod_shares_the_socket_directory_and_dev_shm():
    """Engine and sidecar mount one emptyDir at the socket's directory's parent (the socket's own
    directory is one the daemon creates, since the volume's root is world-writable) and one
    memory-backed emptyDir at /dev/shm, sized above the L2 pool, which the sidecar's memory
    limit holds too; the engine's vLLM connector points at the same socket."""
    _, pod, sidecar, engine = _pod()
    volumes = {v["name"]: v for v in pod["volumes"]}
    env = _env(sidecar)
    config = serve_config(sidecar["args"], env)
    socket_dir = os.path.dirname(config.socket_path)
    parent = os.path.dirname(socket_dir)
    assert _env(engine)["KVCACHED_SOCKET"] == config.socket_path
    for container in (sidecar, engine):
        mounts = _mounts(container)
        assert parent in mounts and socket_dir not in mounts, (container["name"], mounts)
        assert "emptyDir" in volumes[mounts[parent]]
    assert _mounts(sidecar)[parent] == _mounts(engine)[parent]
    assert _mounts(sidecar)["/dev/shm"] == _mounts(engine)["/dev/shm"]
    shm = volumes[_mounts(sidecar)["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and quantity_bytes(shm["sizeLimit"]) > config.l2_bytes
    assert quantity_bytes(sidecar["resources"]["limits"]["memory"]) > config.l2_bytes
    command = engine["command"]
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_extra_config"]["socket"] == config.socket_path
    assert transfer["kv_load_failure_policy"] == "recompute"


def test_k8s_pod_probes_status_and_runs_non_root():
    """Liveness, readiness and startup probes GET /status on the port kvcached's --http listens
    on (all addresses: the kubelet probes the pod's IP); the pod runs as one non-root user,
    without privilege escalation, without hostIPC; the Service targets the same port."""
    docs, pod, sidecar, engine = _pod()
    config = serve_config(sidecar["args"], _env(sidecar))
    host, port = parse_http_address(config.http_address)
    assert host == "0.0.0.0" and config.http_required
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = sidecar[probe]["httpGet"]
        assert get["path"] == "/status" and ports[get["port"]] == port, probe
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    for container in (sidecar, engine):
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert "runAsUser" not in container.get("securityContext", {})     # one uid for both: the pod's
    assert not pod.get("hostIPC") and not pod.get("hostPID")
    assert pod["shareProcessNamespace"] is True
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["ports"][0]["targetPort"] in ports
    assert "hostIPC" in open(os.path.join(DEPLOY, "k8s", "README.md")).read()


DAEMONSET_MANIFEST = os.path.join(DEPLOY, "k8s", "kvcached-daemonset.yaml")


def test_k8s_daemonset_owns_the_node_directories_that_engine_pods_mount_at_its_paths():
    """One daemon per node: a DaemonSet whose daemon keeps its socket directory's parent, its
    shared-memory directory (--shm-dir, on the node's memory-backed /dev/shm) and its L3 in hostPath
    volumes, which an init container makes as the daemon's uid, 0700; engine pods mount the same
    node paths at the same paths (engines open the pool by the path the daemon names), as the same
    uid, with a /dev/shm of their own; neither side needs hostIPC, hostPID or to run as root."""
    docs = list(yaml.safe_load_all(open(DAEMONSET_MANIFEST)))
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    engines = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    [daemon] = daemonset["containers"]
    [init] = daemonset["initContainers"]
    [engine] = engines["containers"]
    config = serve_config(daemon["args"], _env(daemon))
    socket_dir = os.path.dirname(config.socket_path)
    uid = daemonset["securityContext"]["runAsUser"]
    assert uid != 0 and engines["securityContext"]["runAsUser"] == uid

    def host_paths(pod: dict, container: dict) -> dict[str, str]:
        volumes = {v["name"]: v for v in pod["volumes"]}
        return {path: volumes[name]["hostPath"]["path"] for path, name in _mounts(container).items()
                if "hostPath" in volumes[name]}

    daemon_paths, engine_paths = host_paths(daemonset, daemon), host_paths(engines, engine)
    shared = {os.path.dirname(socket_dir), config.shm_dir}
    assert config.shm_dir != "/dev/shm" and config.shm_dir.startswith("/dev/shm/")
    assert {path: daemon_paths[path] for path in shared} == {path: engine_paths[path] for path in shared}
    assert set(engine_paths) == shared and config.l3_path.startswith(tuple(daemon_paths))
    assert init["command"][:8] == ["install", "-d", "-o", str(uid), "-g", str(uid), "-m", "0700"]
    assert set(init["command"][8:]) == {socket_dir, config.shm_dir, os.path.dirname(config.l3_path)}
    assert host_paths(daemonset, init) == daemon_paths
    engine_volumes = {v["name"]: v for v in engines["volumes"]}
    assert engine_volumes[_mounts(engine)["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert quantity_bytes(daemon["resources"]["limits"]["memory"]) > config.l2_bytes
    assert _env(engine)["KVCACHED_SOCKET"] == config.socket_path
    command = engine["command"]
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_extra_config"]["socket"] == config.socket_path
    for pod in (daemonset, engines):
        assert not pod.get("hostIPC") and not pod.get("hostPID") and not pod.get("hostNetwork")
    for container in (daemon, engine):
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert "runAsUser" not in container["securityContext"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    probes = {daemon[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert probes == {"/status"} and parse_http_address(config.http_address)[0] == "0.0.0.0"
    readme = open(os.path.join(DEPLOY, "k8s", "README.md")).read()
    assert "kvcached-daemonset.yaml" in readme and "hostPID" in readme


# Options that would break the daemon (each with why, in the unit's comments).
BREAKING_OPTIONS = {"PrivateDevices": "yes", "PrivateIPC": "yes", "ProtectProc": "invisible", "DynamicUser": "yes",
                    "MemoryDenyWriteExecute": "yes", "RemoveIPC": "yes"}


def test_systemd_unit_runtime_directory_memlock_and_hardening():
    """The unit puts the socket in its RuntimeDirectory= (0700), sets LimitMEMLOCK=infinity, runs
    kvcached with a command line the CLI accepts, and hardens the service with options that keep
    /dev/shm shared (ProtectSystem=strict leaves /dev alone) and none that breaks it."""
    service = parse_unit(UNIT)["Service"]
    env = dict(value.split("=", 1) for value in service["Environment"])
    argv = shlex.split(service["ExecStart"][0])
    assert argv[:2] == ["/usr/bin/env", "kvcached"]
    config = serve_config(argv[2:], env)
    assert service["RuntimeDirectory"] == ["kvcached"] and service["RuntimeDirectoryMode"] == ["0700"]
    assert os.path.dirname(config.socket_path) == "/run/kvcached"
    assert config.l3_path.startswith("/var/lib/kvcached/") and service["StateDirectory"] == ["kvcached"]
    assert parse_http_address(config.http_address)[0] == "127.0.0.1"
    assert service["LimitMEMLOCK"] == ["infinity"]
    for option, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                          "PrivateTmp": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
                          "ProtectControlGroups": "yes", "RestrictSUIDSGID": "yes", "RestrictNamespaces": "yes",
                          "CapabilityBoundingSet": ""}.items():
        assert service.get(option) == [value], option
    for option, value in BREAKING_OPTIONS.items():
        assert value not in service.get(option, []), option
    assert set(service["RestrictAddressFamilies"][0].split()) >= {"AF_UNIX", "AF_INET"}


def test_engine_drop_in_matches_the_unit():
    """The engines' drop-in runs them as the daemon's user, points them at its socket, lifts the
    locked-memory limit for pinning, and keeps /dev/shm and the IPC namespace shared."""
    unit = parse_unit(UNIT)["Service"]
    drop_in = parse_unit(ENGINE_DROP_IN)
    service = drop_in["Service"]
    assert service["User"] == unit["User"]
    assert service["Environment"] == [v for v in unit["Environment"] if v.startswith("KVCACHED_SOCKET=")]
    assert service["LimitMEMLOCK"] == ["infinity"]
    assert service["PrivateDevices"] == ["no"] and service["PrivateIPC"] == ["no"]
    assert "kvcached.service" in drop_in["Unit"]["After"][0]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_analyze_knows_every_option(tmp_path):
    """systemd's own checker reads the unit without a warning (an unknown or misspelt option warns)."""
    result = subprocess.run(["systemd-analyze", "verify", UNIT], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


def test_remote_drop_in_names_the_master_unit_ports():
    """The remote tier's node drop-in runs kvcached with a command line the CLI accepts, naming the
    master at the RPC port mooncake-master.service serves, whose own metadata server is where the
    daemon looks by default."""
    drop_in = parse_unit(os.path.join(DEPLOY, "systemd", "kvcached-remote.conf"))["Service"]
    assert drop_in["ExecStart"][0] == ""             # replaces the unit's command
    argv = shlex.split(drop_in["ExecStart"][1])
    assert argv[:2] == ["/usr/bin/env", "kvcached"]
    config = serve_config(argv[2:], {"KVCACHED_SOCKET": "/run/kvcached/kvcached.sock"})
    master = shlex.split(parse_unit(os.path.join(DEPLOY, "systemd", "mooncake-master.service"))["Service"]
                         ["ExecStart"][0])
    assert master[:2] == ["/usr/bin/env", "mooncake_master"]
    flags = dict(arg.lstrip("-").split("=", 1) for arg in master[2:])
    assert config.remote_master == f"MASTER:{flags['rpc_port']}"
    assert flags["enable_http_metadata_server"] == "true"
    assert config.remote_metadata_server == f"http://MASTER:{flags['http_metadata_server_port']}/metadata"
    assert config.remote_segment_bytes > 0
