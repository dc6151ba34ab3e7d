"""What a reviewer checks in the Kubernetes manifest and the container build file: the mounts
match the config the daemon reads, the security context, cheap probes of the heartbeat file the
daemon writes (test_daemon_profile.py runs them on a real one), resources, the profile mount that
profile.path names, hostPID, no GPU request, and an image that runs `nccltune daemon`; every
manifest valid against the Kubernetes API's schemas (kubernetes-validate, offline, strict), Pod
Security labels, /dev/shm, memory requested as limited, the CDI spec directory, a C compiler.
Rank isolation: the pod keeps exactly the systemd unit's capabilities, the image creates the rank
user the config names (its commands run here against an /etc of their own), no service account
token, the config and profiles on volumes the trust rule accepts, root's caches root's alone
(test_rank_credentials.py runs ranks under this security context). The device plugin: a second
container of the same image running `nccltune device-plugin` with the kubelet's device-plugin
socket directory mounted, the CDI spec read-only, no capability, and the image installing the k8s
extra it needs."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from containerfile import CONTAINERFILE, image_stage, instructions, option, rank_account, user_db

from nccltune.config import DEFAULT_STATE_DIR, Config, load_config
from nccltune.daemon.actions import HEARTBEAT_FILE
from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.fleet.apply import ProfileRefused, trusted_profile

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "kubernetes" / "nccltune-daemonset.yaml"
UNITS = (ROOT / "systemd" / "nccltune.service", ROOT / "systemd" / "nccltune-sweep.service")
# The kubelet's modes for a volume's top directory: an emptyDir on disk (and so a configMap
# volume, which wraps one) is made 0777; a tmpfs (an emptyDir of medium Memory, a projected
# volume) gets tmpfs's own 1777.
KUBELET_DISK_DIR_MODE = 0o777
KUBELET_TMPFS_DIR_MODE = 0o1777


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    out = {}
    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        if doc:
            out[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return out


@pytest.fixture(scope="module")
def pod(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = docs["DaemonSet/nccltune"]["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def container(pod: dict[str, Any]) -> dict[str, Any]:
    """The daemon's container."""
    assert [c["name"] for c in pod["containers"]] == ["nccltune", "device-plugin"]
    return dict(pod["containers"][0])


@pytest.fixture(scope="module")
def device_plugin(pod: dict[str, Any]) -> dict[str, Any]:
    """The device plugin's container, beside the daemon's."""
    return dict(next(c for c in pod["containers"] if c["name"] == "device-plugin"))


def _mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return dict(next(v for v in pod["volumes"] if v["name"] == name))


def _configmap(volume: dict[str, Any]) -> dict[str, Any]:
    """The ConfigMap a volume projects: its only source."""
    (source,) = volume["projected"]["sources"]
    return dict(source["configMap"])


def _unit_capabilities() -> set[str]:
    """The capabilities both systemd units keep (CapabilityBoundingSet=), without CAP_."""
    found = []
    for unit in UNITS:
        (line,) = [ln for ln in unit.read_text().splitlines() if ln.startswith("CapabilityBoundingSet=")]
        found.append({c.removeprefix("CAP_") for c in line.partition("=")[2].split()})
    assert found[0] == found[1]
    return found[0]


def test_config_mount_holds_a_config_the_daemon_accepts(docs: dict[str, Any], pod: dict[str, Any],
                                                        container: dict[str, Any], tmp_path: Path) -> None:
    args = container["args"]
    config_path = Path(args[args.index("--config") + 1])
    mount = _mounts(container)[str(config_path.parent)]
    assert mount["readOnly"] is True
    cm = docs[f"ConfigMap/{_configmap(_volume(pod, mount['name']))['name']}"]
    text = cm["data"][config_path.name]
    (tmp_path / "config.yaml").write_text(text)
    cfg = load_config(tmp_path / "config.yaml", required=True)  # the daemon's own loader: no unknown key
    # The state dir the daemon uses is the hostPath, at the same path as on the host (the launchers
    # and the Slurm prolog read /var/lib/nccltune/nccl.env there).
    state = _mounts(container)[cfg.state_dir]
    vol = _volume(pod, state["name"])
    assert vol["hostPath"] == {"path": DEFAULT_STATE_DIR, "type": "DirectoryOrCreate"}
    assert cfg.state_dir == DEFAULT_STATE_DIR and not state.get("readOnly", False)
    assert cfg.metrics_dir is not None and str(cfg.metrics_dir).startswith(cfg.state_dir + "/")
    # bench.python lives on a read-only host mount, not in the image.
    bench = cfg.bench.python
    assert bench is not None
    host_env = next(m for p, m in _mounts(container).items() if bench.startswith(p + "/"))
    assert host_env["readOnly"] is True and "hostPath" in _volume(pod, host_env["name"])


def _daemon_config(docs: dict[str, Any], pod: dict[str, Any], container: dict[str, Any], tmp_path: Path) -> Config:
    """The config the daemon reads in the pod, through its own loader."""
    args = container["args"]
    config_path = Path(args[args.index("--config") + 1])
    cm = docs[f"ConfigMap/{_configmap(_volume(pod, _mounts(container)[str(config_path.parent)]['name']))['name']}"]
    (tmp_path / "config.yaml").write_text(cm["data"][config_path.name])
    return load_config(tmp_path / "config.yaml", required=True)


def test_profile_comes_from_a_configmap(docs: dict[str, Any], pod: dict[str, Any], container: dict[str, Any],
                                        tmp_path: Path) -> None:
    mount = _mounts(container)["/etc/nccltune/profile"]
    assert mount["readOnly"] is True
    assert "subPath" not in mount  # a subPath mount never sees a ConfigMap update
    source = _configmap(_volume(pod, mount["name"]))
    assert source["name"] == "nccltune-profile"
    assert source["optional"] is True  # a class without a profile still runs
    # The daemon's profile.path is that mount: the directory of <class id>.json profiles.
    cfg = _daemon_config(docs, pod, container, tmp_path)
    assert cfg.profile_path == Path(mount["mountPath"])


def test_gpu_access_without_taking_the_gpus(pod: dict[str, Any], container: dict[str, Any]) -> None:
    assert pod["runtimeClassName"] == "nvidia"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "compute" in env["NVIDIA_DRIVER_CAPABILITIES"] and "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]
    for section in ("requests", "limits"):
        assert not any(k.startswith("nvidia.com/") for k in container["resources"].get(section, {}))
    assert pod["hostPID"] is True  # NVML's process list names host PIDs
    assert pod["hostNetwork"] is True  # the node's NICs, for the topology and the class
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_security_context(container: dict[str, Any]) -> None:
    sc = container["securityContext"]
    assert sc["runAsUser"] == 0  # publishes root-owned files
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    # With a read-only root, everything written has a volume: state, caches, /tmp.
    env = {e["name"]: e.get("value") for e in container["env"]}
    writable = {p for p, m in _mounts(container).items() if not m.get("readOnly", False)}
    assert {"/var/lib/nccltune", "/tmp", env["XDG_CACHE_HOME"]} <= writable
    assert env["CUDA_CACHE_PATH"].startswith(env["XDG_CACHE_HOME"] + "/")


def test_probes_are_cheap_and_read_the_heartbeat(container: dict[str, Any]) -> None:
    for name in ("livenessProbe", "startupProbe"):
        probe = container[name]
        cmd = probe["exec"]["command"]
        assert cmd[:2] == ["/bin/sh", "-c"]
        script = cmd[2]
        # The file the daemon writes (daemon.actions.HEARTBEAT_FILE in its state directory).
        assert f"{DEFAULT_STATE_DIR}/{HEARTBEAT_FILE}" in script
        # No Python, no NVML, no nccltune command: a file's age only.
        assert not re.search(r"\b(python|nccltune |nvidia-smi)", script)
        shlex.split(script)  # well-formed quoting
        assert probe["timeoutSeconds"] <= 5 and probe["periodSeconds"] >= 30


def test_resources_priority_and_updates(docs: dict[str, Any], pod: dict[str, Any], container: dict[str, Any]) -> None:
    res = container["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
    assert "cpu" not in res["limits"]  # throttling would skew small-message timings
    prio = docs[f"PriorityClass/{pod['priorityClassName']}"]
    assert prio["preemptionPolicy"] == "Never"
    ds = docs["DaemonSet/nccltune"]["spec"]
    assert ds["updateStrategy"]["type"] == "RollingUpdate"
    assert ds["selector"]["matchLabels"].items() <= ds["template"]["metadata"]["labels"].items()
    assert pod["terminationGracePeriodSeconds"] >= 90  # as the systemd unit's TimeoutStopSec


def test_image_runs_the_daemon_as_root_without_torch(container: dict[str, Any]) -> None:
    ins = instructions()
    entry = [rest for word, rest in ins if word == "ENTRYPOINT"]
    assert len(entry) == 1
    argv = json.loads(entry[0])  # exec form: signals reach nccltune, not a shell
    assert Path(argv[0]).name == "nccltune" and argv[1:] == ["daemon"]
    assert ("USER", "0") in ins
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert "pip install" in runs and not re.search(r"\btorch\b", runs)
    assert container["args"][0].startswith("--")  # arguments to the daemon, not a command


@pytest.mark.parametrize("version", ["1.28", "1.37"])
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version: str) -> None:
    """kubernetes-validate bundles the API's OpenAPI schemas: no cluster, no network. Strict:
    a misspelt or misplaced field is an error, not ignored."""
    docs = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    assert len(docs) == 4
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    broken = dict(docs[-1])
    broken["spec"] = {**broken["spec"], "updateStrategi": {}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_the_namespace_carries_pod_security_labels(docs: dict[str, Any]) -> None:
    labels = docs["Namespace/nccltune"]["metadata"]["labels"]
    # hostPID, hostNetwork and hostPath need the privileged level; tenants' namespaces stay stricter.
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "baseline"
    assert labels["pod-security.kubernetes.io/audit"] == "baseline"


def test_dev_shm_is_a_memory_volume_with_a_size_limit(pod: dict[str, Any], container: dict[str, Any]) -> None:
    shm = _volume(pod, _mounts(container)["/dev/shm"]["name"])
    assert shm["emptyDir"]["medium"] == "Memory"
    assert shm["emptyDir"]["sizeLimit"]


def test_memory_is_requested_as_limited(container: dict[str, Any]) -> None:
    res = container["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"]


def test_the_cdi_spec_directory_is_the_hosts_and_the_daemon_writes_there(
        docs: dict[str, Any], pod: dict[str, Any], container: dict[str, Any], tmp_path: Path) -> None:
    cfg = _daemon_config(docs, pod, container, tmp_path)
    assert cfg.cdi_dir == Path("/var/run/cdi")
    mount = _mounts(container)[str(cfg.cdi_dir)]
    assert not mount.get("readOnly", False)
    assert _volume(pod, mount["name"])["hostPath"]["path"] == str(cfg.cdi_dir)


def test_the_image_has_a_c_compiler_for_the_tuner_plugin() -> None:
    final_stage = CONTAINERFILE.read_text().rsplit("\nFROM ", 1)[1]
    runs = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert re.search(r"apt-get install .*\bgcc\b.*\blibc6-dev\b", runs)
    assert "gcc" in final_stage  # in the image that runs, not only in the build stage


# -- rank isolation --------------------------------------------------------------------------------

# The capabilities Pod Security's baseline level lets a container add.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}


def test_the_pod_keeps_exactly_the_units_capabilities(pod: dict[str, Any], container: dict[str, Any]) -> None:
    """Read from both files, so that the unit and the DaemonSet cannot drift apart."""
    caps = container["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"]
    assert len(caps["add"]) == len(set(caps["add"]))
    assert set(caps["add"]) == _unit_capabilities()
    # allowPrivilegeEscalation: false, which the API refuses beside privileged or SYS_ADMIN.
    assert "SYS_ADMIN" not in caps["add"] and container["securityContext"]["allowPrivilegeEscalation"] is False
    assert set(caps["add"]) <= BASELINE_CAPABILITIES
    for other in [*pod.get("initContainers", []), *pod["containers"][1:]]:
        assert other["securityContext"]["capabilities"] == {"drop": ["ALL"]}, other["name"]


def test_the_image_creates_the_rank_user_the_config_names(docs: dict[str, Any], pod: dict[str, Any],
                                                          container: dict[str, Any], tmp_path: Path) -> None:
    account = rank_account()
    cfg = _daemon_config(docs, pod, container, tmp_path)
    assert cfg.bench.user == account.name
    assert account.group == account.name and account.gid == account.uid
    # A number no account of a node has: not a system or a regular user's, none of systemd's ranges
    # (homed, nspawn's, dynamic users), not nobody.
    assert not (account.uid < 60000 or 60001 <= account.uid <= 60577 or 61184 <= account.uid <= 65535)
    assert {"--system", "--no-create-home"} <= set(account.options)
    assert option(list(account.options), "--shell", "-s").endswith("nologin")
    # Every uid the manifest and the docs (docs/kubernetes.md says it) name for the ranks is that one.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {doc.name: {int(n) for n in re.findall(r"\buid (?:and gid )?(\d{4,})", doc.read_text())}
             for doc in (MANIFEST, *pages)}
    assert named.pop(MANIFEST.name) == {account.uid} and set().union(*named.values()) <= {account.uid}, named
    # The user is made before the image switches back to root for the daemon, which it stays.
    stage = image_stage()
    made = next(i for i, (word, rest) in enumerate(stage) if word == "RUN" and "useradd" in rest)
    users = [(i, rest) for i, (word, rest) in enumerate(stage) if word == "USER"]
    assert users[-1][1] == "0" and users[-1][0] > made


def test_the_images_user_setup_runs(tmp_path: Path) -> None:
    """The Containerfile's own groupadd and useradd, run here with --prefix against a base image's
    /etc: the account they make is the one the tests and the config expect, in no other group."""
    if os.geteuid() != 0:
        pytest.skip("shadow's tools write their files as root (CI runs as root)")
    if shutil.which("useradd") is None or shutil.which("groupadd") is None:
        pytest.skip("useradd/groupadd are not installed here (Debian/Ubuntu: the passwd package)")
    account = rank_account()
    etc = user_db(tmp_path / "image")
    users = {f[0]: f for f in (line.split(":") for line in (etc / "passwd").read_text().splitlines())}
    groups = {f[0]: f for f in (line.split(":") for line in (etc / "group").read_text().splitlines())}
    _, _, uid, gid, _, home, shell = users[account.name]
    assert (int(uid), int(gid), home) == (account.uid, account.gid, "/nonexistent")
    assert shell.endswith("nologin")
    assert int(groups[account.group][2]) == account.gid
    assert not [g for g, f in groups.items() if account.name in f[3].split(",")]  # its own group only
    assert not (tmp_path / "image" / "nonexistent").exists()


def test_no_service_account_token_and_no_api_access(docs: dict[str, Any], pod: dict[str, Any]) -> None:
    """The daemon reads its config and the profiles from mounted files; the pod gets no token (the
    ranks could read a mounted one), and there is no role to give one a use."""
    assert pod["automountServiceAccountToken"] is False
    kinds = {key.partition("/")[0] for key in docs}
    assert not kinds & {"ServiceAccount", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
    for path in sorted((ROOT / "nccltune").rglob("*.py")):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+kubernetes\b", text, re.M), path
        for marker in ("KUBERNETES_SERVICE_HOST", "/var/run/secrets/kubernetes.io", "serviceaccount/token"):
            assert marker not in text, (path, marker)


def _kubelet_volume(top: Path, mode: int, files: dict[str, str]) -> None:
    """A directory as the kubelet's atomic writer lays out a ConfigMap: the top directory of the
    volume's `mode`, the files (0644) in a version directory (0755), `..data` naming it, and a link
    per file through `..data`."""
    version = top / "..2026_01_01_00_00_00.000000001"
    version.mkdir(parents=True)
    version.chmod(0o755)
    for name, text in files.items():
        (version / name).write_text(text)
        (version / name).chmod(0o644)
        (top / name).symlink_to(f"..data/{name}")
    (top / "..data").symlink_to(version.name)
    top.chmod(mode)


def test_the_config_and_profiles_are_on_volumes_the_trust_rule_accepts(
        docs: dict[str, Any], pod: dict[str, Any], container: dict[str, Any], tmp_path: Path) -> None:
    """A configMap volume's top directory is world-writable, and the daemon refuses its config
    there (exit 78) as it would any; a projected volume's is sticky, as /tmp is, and accepted."""
    args = container["args"]
    config_path = Path(args[args.index("--config") + 1])
    cfg = _daemon_config(docs, pod, container, tmp_path)
    assert cfg.profile_path is not None
    for path in (config_path.parent, cfg.profile_path):
        vol = _volume(pod, _mounts(container)[str(path)]["name"])
        assert "projected" in vol and "configMap" not in vol, vol["name"]
    cm = docs[f"ConfigMap/{_configmap(_volume(pod, _mounts(container)[str(config_path.parent)]['name']))['name']}"]
    files = {config_path.name: cm["data"][config_path.name], "class-0123.json": "{}\n"}
    kept = tmp_path / "kept"
    kept.mkdir()
    for kind, mode in (("configMap", KUBELET_DISK_DIR_MODE), ("projected", KUBELET_TMPFS_DIR_MODE)):
        top = tmp_path / kind
        _kubelet_volume(top, mode, files)
        if kind == "configMap":
            with pytest.raises(InputError, match="world-writable") as refused:
                load_config(top / config_path.name, required=True)
            assert refused.value.exit_code == EXIT_CONFIG
            with pytest.raises(ProfileRefused, match="world-writable"):
                trusted_profile(top / "class-0123.json")
        else:
            assert stat.S_IMODE(top.stat().st_mode) == 0o1777
            assert load_config(top / config_path.name, required=True).bench.python == cfg.bench.python
            real = trusted_profile(top / "class-0123.json")
            assert real.parent.name.startswith("..2026") and real.name == "class-0123.json"


def test_roots_caches_are_root_only(pod: dict[str, Any], container: dict[str, Any]) -> None:
    """Every writable emptyDir on disk comes 0777; the init container makes each 0755 (root owns
    it, so with no capability) before the daemon and its ranks start. The memory-backed ones are
    tmpfs, sticky, as /tmp and /dev/shm are on a node."""
    env = {e["name"]: e.get("value") for e in container["env"]}
    on_disk = set()
    for path, mount in _mounts(container).items():
        vol = _volume(pod, mount["name"])
        if "emptyDir" in vol and not mount.get("readOnly", False) and vol["emptyDir"].get("medium") != "Memory":
            on_disk.add(path)
    assert on_disk == {env["XDG_CACHE_HOME"]}
    (init,) = pod["initContainers"]
    assert init["image"] == container["image"]
    assert init["command"][:2] == ["/bin/chmod", "0755"] and set(init["command"][2:]) == on_disk
    assert {m["mountPath"]: m["name"] for m in init["volumeMounts"]} == {
        p: _mounts(container)[p]["name"] for p in on_disk}
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0 and sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"


# -- the device plugin -----------------------------------------------------------------------------


def test_the_device_plugin_runs_beside_the_daemon_with_the_kubelets_socket_directory(
        docs: dict[str, Any], pod: dict[str, Any], container: dict[str, Any], device_plugin: dict[str, Any],
        tmp_path: Path) -> None:
    from nccltune.cli.parser import build_parser
    from nccltune.k8s.deviceplugin import PLUGIN_DIR

    assert device_plugin["image"] == container["image"]
    # The image's own nccltune (its ENTRYPOINT's executable), as the command device-plugin.
    (entry,) = [json.loads(rest) for word, rest in instructions() if word == "ENTRYPOINT"]
    assert device_plugin["command"] == [entry[0], "device-plugin"]
    args = build_parser().parse_args(["device-plugin", *device_plugin["args"]])
    assert args.command == "device-plugin" and args.cdi_dir is None  # publish.cdi_dir of the config
    # The kubelet's device-plugin directory, writable: the plugin's sockets go beside kubelet.sock.
    plugin = _mounts(device_plugin)[args.plugin_dir]
    assert Path(args.plugin_dir) == PLUGIN_DIR and not plugin.get("readOnly", False)
    assert _volume(pod, plugin["name"])["hostPath"] == {"path": str(PLUGIN_DIR), "type": "Directory"}
    # The daemon's config, from the same volume, and the CDI spec directory it publishes, read-only.
    assert args.config == container["args"][container["args"].index("--config") + 1]
    config = _mounts(device_plugin)[str(Path(args.config).parent)]
    assert config["readOnly"] is True and config["name"] == _mounts(container)[str(Path(args.config).parent)]["name"]
    cfg = _daemon_config(docs, pod, container, tmp_path)
    assert cfg.cdi_dir is not None
    cdi = _mounts(device_plugin)[str(cfg.cdi_dir)]
    assert cdi["readOnly"] is True and cdi["name"] == _mounts(container)[str(cfg.cdi_dir)]["name"]
    assert set(_mounts(device_plugin)) == {args.plugin_dir, str(Path(args.config).parent), str(cfg.cdi_dir)}


def test_the_device_plugins_security_and_resources(device_plugin: dict[str, Any]) -> None:
    sc = device_plugin["securityContext"]
    assert sc["runAsUser"] == 0  # the kubelet's socket directory is root's
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["seccompProfile"]["type"] == "RuntimeDefault"
    res = device_plugin["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"] and "cpu" not in res["limits"]
    for section in ("requests", "limits"):
        assert not any(k.startswith("nvidia.com/") for k in res[section])


def test_the_image_installs_the_k8s_extra_for_the_device_plugin() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("grpcio") for dep in extras["k8s"])
    installs = [shlex.split(rest) for word, rest in instructions() if word == "RUN" and "pip install" in rest]
    (line,) = installs
    assert "/src[k8s]" in line, line
