"""`nccltune doctor`: diagnose() on recorded topologies, and the command with --input --json."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from publishing import publish_set

from nccltune.checks.doctor import Finding, diagnose, read_conf_file, socket_ifname_matches
from nccltune.cli import main
from nccltune.delivery.jobenv import decide
from nccltune.nccl.sitetuner import default_conf_files
from nccltune.publish import Provenance
from nccltune.topology.fingerprint import topology_fingerprint
from nccltune.topology.model import Topology
from nccltune.topology.paths import compute_paths
from nccltune.topology.source import bundled_topologies_dir, load_topology

NVSWITCH = "h200x2-nvswitch-vm"
PCIE_ONLY = "pcie-4gpu-2socket"
NVLINK_SNAPSHOTS = ("h200x2-nvswitch-vm", "dgx-a100-8gpu", "hgx-h100-8gpu", "pcie-2gpu-nvlink-bridge")
ALL_SNAPSHOTS = (*NVLINK_SNAPSHOTS, PCIE_ONLY)


def topo(name: str) -> Topology:
    return load_topology(name)


def run(t: Topology, tmp_path: Path, env: dict[str, str] | None = None, conf: list[Path] | None = None,
        publish_dir: Path | None = None) -> list[Finding]:
    return diagnose(t, compute_paths(t), env=env or {}, publish_dir=publish_dir or tmp_path / "nothing-published",
                    conf_files=conf or [], topologyd_file=tmp_path / "no-topologyd.xml")


def codes(findings: list[Finding], severity: str | None = None) -> list[str]:
    return [f.code for f in findings if severity is None or f.severity == severity]


def one(findings: list[Finding], code: str) -> Finding:
    found = [f for f in findings if f.code == code]
    assert len(found) == 1, findings
    return found[0]


def conf_file(tmp_path: Path, text: str, name: str = "nccl.conf") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode())
    return path


def publish_for(t: Topology, directory: Path, env: dict[str, str], *, fingerprint: str | None = None,
                demo: bool = False) -> None:
    prov = Provenance(nccltune_version="0.1.0", created_at="2026-01-01T00:00:00+00:00",
                      topology_fingerprint=fingerprint or topology_fingerprint(t), nccl_version="2.21.5",
                      backend="nccl", demo=demo, profile="balanced")
    publish_set(directory, env, prov)


# -- a clean node ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_SNAPSHOTS)
def test_a_clean_environment_has_no_errors_or_warnings(name: str, tmp_path: Path) -> None:
    findings = run(topo(name), tmp_path)
    assert codes(findings, "error") == [] and codes(findings, "warning") == []
    # What remains is informational (the PCIe snapshot was recorded idle, at Gen1).
    assert set(codes(findings)) <= {"pcie-gen"}


# -- P2P -------------------------------------------------------------------------------------------


def test_p2p_disabled_on_nvswitch_is_an_error(tmp_path: Path) -> None:
    f = one(run(topo(NVSWITCH), tmp_path, {"NCCL_P2P_DISABLE": "1"}), "p2p-disabled")
    assert f.severity == "error"
    assert "NCCL_P2P_DISABLE=1 (from the environment)" in f.message and "NVLink" in f.message
    assert "unset NCCL_P2P_DISABLE" in f.fix
    assert "p2p-disabled" not in codes(run(topo(NVSWITCH), tmp_path, {"NCCL_P2P_DISABLE": "0"}))
    # Without NVLink, P2P off is a choice with a cost, not this error.
    assert "p2p-disabled" not in codes(run(topo(PCIE_ONLY), tmp_path, {"NCCL_P2P_DISABLE": "1"}))


def test_p2p_level_in_lower_case_is_an_error_naming_the_silent_ignore(tmp_path: Path) -> None:
    findings = run(topo(NVSWITCH), tmp_path, {"NCCL_P2P_LEVEL": "nvl"})
    f = one(findings, "invalid-value")
    assert f.severity == "error"
    assert "NCCL_P2P_LEVEL" in f.message and "silently ignores 'nvl'" in f.message and "'NVL'" in f.message
    assert codes(run(topo(NVSWITCH), tmp_path, {"NCCL_P2P_LEVEL": "NVL"}), "error") == []


def test_p2p_level_loc_turns_off_nvlink(tmp_path: Path) -> None:
    f = one(run(topo(NVSWITCH), tmp_path, {"NCCL_P2P_LEVEL": "LOC"}), "p2p-level-loc")
    assert f.severity == "error"


# -- LL128 -----------------------------------------------------------------------------------------


def test_ll128_on_a_pcie_only_node_is_an_error(tmp_path: Path) -> None:
    f = one(run(topo(PCIE_ONLY), tmp_path, {"NCCL_PROTO": "LL128"}), "explicit-ll128")
    assert f.severity == "error"
    assert "would not enable it" in f.message and "corruption" in f.message


@pytest.mark.parametrize("name", NVLINK_SNAPSHOTS)
def test_ll128_on_nvlink_is_only_a_warning(name: str, tmp_path: Path) -> None:
    f = one(run(topo(name), tmp_path, {"NCCL_PROTO": "LL128"}), "explicit-ll128")
    assert f.severity == "warning"
    assert "would enable it here anyway" in f.message


@pytest.mark.parametrize("value", ["Simple,LL128", "allreduce:ll128", "LL,LL128,Simple"])
def test_ll128_is_found_in_lists_and_per_function_values(value: str, tmp_path: Path) -> None:
    assert one(run(topo(PCIE_ONLY), tmp_path, {"NCCL_PROTO": value}), "explicit-ll128").severity == "error"


@pytest.mark.parametrize("value", ["^LL128", "Simple", "LL"])
def test_excluding_or_not_naming_ll128_is_fine(value: str, tmp_path: Path) -> None:
    assert "explicit-ll128" not in codes(run(topo(PCIE_ONLY), tmp_path, {"NCCL_PROTO": value}))


# -- torch and debugging leftovers -----------------------------------------------------------------


def test_deprecated_async_error_handling_warns(tmp_path: Path) -> None:
    f = one(run(topo(NVSWITCH), tmp_path, {"NCCL_ASYNC_ERROR_HANDLING": "1"}), "deprecated-async-error-handling")
    assert f.severity == "warning" and "deprecated" in f.message
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in f.fix
    both = one(run(topo(NVSWITCH), tmp_path, {"NCCL_ASYNC_ERROR_HANDLING": "1",
                                              "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}),
               "deprecated-async-error-handling")
    assert "wins over it" in both.message


@pytest.mark.parametrize(("value", "warned"), [("INFO", True), ("info", True), ("TRACE", True), ("WARN", False)])
def test_nccl_debug_left_on_warns(value: str, warned: bool, tmp_path: Path) -> None:
    findings = run(topo(NVSWITCH), tmp_path, {"NCCL_DEBUG": value})
    assert ("debug-on" in codes(findings, "warning")) is warned


# -- NCCL's conf files -----------------------------------------------------------------------------


def test_a_graph_file_in_a_conf_file_is_an_error(tmp_path: Path) -> None:
    conf = conf_file(tmp_path, "# tuned by hand\nNCCL_GRAPH_FILE=/etc/nccl-graph.xml\n")
    f = one(run(topo(NVSWITCH), tmp_path, conf=[conf]), "graph-file-in-conf")
    assert f.severity == "error"
    assert str(conf) in f.message and "/etc/nccl-graph.xml" in f.message
    assert str(conf) in f.fix


def test_a_stale_topo_file_in_a_conf_file_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "gone" / "ncclTopology.xml"
    conf = conf_file(tmp_path, f"NCCL_TOPO_FILE={missing}\n")
    f = one(run(topo(NVSWITCH), tmp_path, conf=[conf]), "stale-topo-file")
    assert f.severity == "error" and str(missing) in f.message and str(conf) in f.message
    present = tmp_path / "ncclTopology.xml"
    present.write_text("<system/>\n")
    conf.write_text(f"NCCL_TOPO_FILE={present}\n")
    assert "stale-topo-file" not in codes(run(topo(NVSWITCH), tmp_path, conf=[conf]))


def test_a_crlf_conf_file_keeps_the_carriage_return_as_nccl_does(tmp_path: Path) -> None:
    # NCCL strips only '\n': the value it sees ends in '\r' and names no file.
    present = tmp_path / "ncclTopology.xml"
    present.write_text("<system/>\n")
    conf = conf_file(tmp_path, f"NCCL_TOPO_FILE={present}\r\nNCCL_DEBUG=INFO\r\n")
    assert read_conf_file(conf) == {"NCCL_TOPO_FILE": f"{present}\r", "NCCL_DEBUG": "INFO\r"}
    findings = run(topo(NVSWITCH), tmp_path, conf=[conf])
    assert one(findings, "stale-topo-file").severity == "error"
    assert "debug-on" not in codes(findings)  # NCCL does not recognise "INFO\r" either


def test_conf_files_are_read_the_way_nccl_reads_them(tmp_path: Path) -> None:
    conf = conf_file(tmp_path, "#NCCL_DEBUG=INFO\nNCCL_DEBUG=WARN\nNCCL_DEBUG=INFO\n no-equals\n"
                               " NCCL_PROTO=LL128\nNCCL_ALGO= Ring\n")
    # The first value of a name wins (setenv without overwrite), nothing is trimmed.
    assert read_conf_file(conf) == {"NCCL_DEBUG": "WARN", " NCCL_PROTO": "LL128", "NCCL_ALGO": " Ring"}
    assert read_conf_file(tmp_path / "missing.conf") == {}


def test_the_environment_wins_over_conf_files_and_the_first_file_over_the_second(tmp_path: Path) -> None:
    first = conf_file(tmp_path, "NCCL_DEBUG=INFO\n", "user.conf")
    second = conf_file(tmp_path, "NCCL_DEBUG=WARN\nNCCL_P2P_DISABLE=1\n", "etc.conf")
    findings = run(topo(NVSWITCH), tmp_path, conf=[first, second])
    assert str(first) in one(findings, "debug-on").message
    assert str(second) in one(findings, "p2p-disabled").message
    findings = run(topo(NVSWITCH), tmp_path, {"NCCL_DEBUG": "WARN", "NCCL_P2P_DISABLE": "0"}, conf=[first, second])
    assert "debug-on" not in codes(findings) and "p2p-disabled" not in codes(findings)


def test_default_conf_files_follow_nccl(tmp_path: Path) -> None:
    assert default_conf_files({"HOME": str(tmp_path)}) == [tmp_path / ".nccl.conf", Path("/etc/nccl.conf")]
    assert default_conf_files({"HOME": str(tmp_path), "NCCL_CONF_FILE": "/x.conf"}) == \
        [Path("/x.conf"), Path("/etc/nccl.conf")]


# -- what nccltune published -----------------------------------------------------------------------


def test_a_job_value_differing_from_the_published_one_is_information_by_the_precedence_rule(tmp_path: Path) -> None:
    """The precedence rule (delivery/jobenv.py) keeps a variable the job sets itself: doctor says
    what the job keeps and what nccltune adds, and warns of nothing."""
    t = topo(NVSWITCH)
    pub = tmp_path / "pub"
    publish_for(t, pub, {"NCCL_ALGO": "Ring", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    findings = run(t, tmp_path, {"NCCL_ALGO": "Tree"}, publish_dir=pub)
    f = one(findings, "env-overrides-published")
    assert f.severity == "info"
    assert "keeps its own NCCL_ALGO=Tree (published: Ring)" in f.message
    assert "the job's decision" in f.message
    added = decide({"NCCL_ALGO": "Ring", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, {"NCCL_ALGO": "Tree"}).applied
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in added
    assert "nccltune adds the other published variables (" in f.message
    assert all(name in f.message.split("adds")[1] for name in added)
    assert "unset NCCL_ALGO" in f.fix
    assert "env-overrides-published" not in codes(findings, "warning") + codes(findings, "error")
    assert codes(run(t, tmp_path, {"NCCL_ALGO": "Ring"}, publish_dir=pub)) == []
    # A job that opted out gets nothing published: nothing of its own is kept over it.
    assert "env-overrides-published" not in codes(
        run(t, tmp_path, {"NCCL_ALGO": "Tree", "NCCLTUNE_DISABLE": "1"}, publish_dir=pub))


def test_a_published_file_writable_by_others_is_an_error(tmp_path: Path) -> None:
    t = topo(NVSWITCH)
    pub = tmp_path / "pub"
    publish_for(t, pub, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert codes(run(t, tmp_path, publish_dir=pub)) == []
    (pub / "nccl.env").chmod(0o666)
    f = one(run(t, tmp_path, publish_dir=pub), "published-writable")
    assert f.severity == "error"
    assert str(pub / "nccl.env") in f.message and "666" in f.message
    assert f.fix == f"chmod 644 {pub / 'nccl.env'}"


def test_a_published_tuning_for_another_topology_is_an_error(tmp_path: Path) -> None:
    t = topo(NVSWITCH)
    pub = tmp_path / "pub"
    publish_for(t, pub, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, fingerprint="0123456789abcdef")
    f = one(run(t, tmp_path, publish_dir=pub), "published-topology-stale")
    assert f.severity == "error"
    assert "0123456789abcdef" in f.message and topology_fingerprint(t) in f.message


def test_a_published_demo_tuning_and_a_missing_topo_file_are_errors(tmp_path: Path) -> None:
    t = topo(NVSWITCH)
    pub = tmp_path / "pub"
    publish_for(t, pub, {"NCCL_TOPO_FILE": str(pub / "ncclTopology.xml")}, demo=True)
    findings = run(t, tmp_path, publish_dir=pub)
    assert set(codes(findings, "error")) == {"published-demo", "published-topo-missing"}


def test_a_corrupt_published_file_is_a_finding_not_a_crash(tmp_path: Path) -> None:
    pub = tmp_path / "pub"
    pub.mkdir()
    (pub / "nccl.json").write_text("{not json")
    f = one(run(topo(NVSWITCH), tmp_path, publish_dir=pub), "published-corrupt")
    assert f.severity == "error" and "nccl.json" in f.message


# -- the node --------------------------------------------------------------------------------------


def _edited(tmp_path: Path, name: str, edit: Any) -> Path:
    snap = json.loads((bundled_topologies_dir() / f"{name}.json").read_text())
    edit(snap)
    path = tmp_path / f"{name}-edited.json"
    path.write_text(json.dumps(snap))
    return path


def test_an_inactive_nvlink_is_an_error(tmp_path: Path) -> None:
    def link_down(snap: dict[str, Any]) -> None:
        snap["nvml"]["gpus"][1]["nvlinks"][5]["active"] = False
    t = load_topology(str(_edited(tmp_path, NVSWITCH, link_down)))
    f = one(run(t, tmp_path), "nvlink-inactive")
    assert f.severity == "error"
    assert "GPU1 (0000:00:07.0): only 17 of 18 NVLinks are active" in f.message


def test_a_narrow_pcie_link_warns(tmp_path: Path) -> None:
    def narrow(snap: dict[str, Any]) -> None:
        snap["nvml"]["gpus"][0]["pcie_cur_width"] = 8
    t = load_topology(str(_edited(tmp_path, NVSWITCH, narrow)))
    f = one(run(t, tmp_path), "pcie-width")
    assert f.severity == "warning" and "x8 of x16" in f.message


# -- the command -----------------------------------------------------------------------------------


def doctor_cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL"))}
    # HOME and NCCL_CONF_FILE point at the test's own (missing) conf file, not the user's.
    base.update(HOME=str(tmp_path), NCCL_CONF_FILE=str(tmp_path / "nccl.conf"), **(env or {}))
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, base, clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["doctor", "--state-dir", str(tmp_path / "state"), *args])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.skipif(Path("/etc/nccl.conf").exists(), reason="this machine has an /etc/nccl.conf")
def test_doctor_json_on_a_clean_snapshot_exits_0(tmp_path: Path) -> None:
    rc, out, err = doctor_cli(tmp_path, "--input", str(bundled_topologies_dir() / f"{NVSWITCH}.json"), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["schema_version"] == 1 and doc["kind"] == "doctor"
    assert doc["counts"] == {"error": 0, "warning": 0, "info": 0}
    assert doc["findings"] == []
    assert NVSWITCH in doc["source"]


def test_doctor_json_with_an_error_exits_1(tmp_path: Path) -> None:
    conf = conf_file(tmp_path, "NCCL_GRAPH_FILE=/tmp/graph.xml\n")
    rc, out, err = doctor_cli(tmp_path, "--input", str(bundled_topologies_dir() / f"{NVSWITCH}.json"), "--json",
                              env={"NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "INFO"})
    assert rc == 1, err
    doc = json.loads(out)
    assert doc["counts"]["error"] == 2 and doc["counts"]["warning"] == 1
    # site-settings: the conf file's NCCL_GRAPH_FILE is the site's (info).
    assert [f["code"] for f in doc["findings"]] == ["p2p-disabled", "graph-file-in-conf", "debug-on", "site-settings"]
    assert all(f["fix"] for f in doc["findings"])
    assert str(conf) in doc["findings"][1]["message"]


def test_doctor_with_only_warnings_exits_0_and_prints_text(tmp_path: Path) -> None:
    rc, out, err = doctor_cli(tmp_path, "--input", PCIE_ONLY, env={"NCCL_DEBUG": "INFO"})
    assert rc == 0, err
    assert "WARNING [debug-on]" in out
    assert "0 error(s), 1 warning(s)" in out


# -- settings that turn P2P off, serialise kernels or take a choice away from NCCL -------------------


def test_p2p_level_nvl_on_a_pcie_only_node_turns_p2p_off(tmp_path: Path) -> None:
    f = one(run(topo(PCIE_ONLY), tmp_path, {"NCCL_P2P_LEVEL": "NVL"}), "p2p-level-off")
    assert f.severity == "warning"
    # The two PIX pairs lose P2P; the SYS pairs never had it by default.
    assert "NCCL_P2P_LEVEL=NVL (from the environment) turns P2P off for 2 GPU pair(s)" in f.message
    assert "GPU0-GPU1 PIX, GPU2-GPU3 PIX" in f.message and "SYS" not in f.message
    assert "p2p-level-off" not in codes(run(topo(PCIE_ONLY), tmp_path, {"NCCL_P2P_LEVEL": "PIX"}))
    # On NVLink the same level keeps P2P: nothing to say.
    assert "p2p-level-off" not in codes(run(topo(NVSWITCH), tmp_path, {"NCCL_P2P_LEVEL": "NVL"}))
    # LOC on NVLink is the one error, not two findings.
    assert codes(run(topo(NVSWITCH), tmp_path, {"NCCL_P2P_LEVEL": "LOC"})).count("p2p-level-loc") == 1
    assert "p2p-level-off" not in codes(run(topo(NVSWITCH), tmp_path, {"NCCL_P2P_LEVEL": "LOC"}))


def test_p2p_level_from_nccl_conf_names_the_file(tmp_path: Path) -> None:
    conf = conf_file(tmp_path, "NCCL_P2P_LEVEL=0\n")
    f = one(run(topo(PCIE_ONLY), tmp_path, conf=[conf]), "p2p-level-off")
    assert f"(from {conf})" in f.message


def test_cuda_launch_blocking_warns(tmp_path: Path) -> None:
    f = one(run(topo(NVSWITCH), tmp_path, {"CUDA_LAUNCH_BLOCKING": "1"}), "cuda-launch-blocking")
    assert f.severity == "warning" and "unset CUDA_LAUNCH_BLOCKING" in f.fix
    assert "cuda-launch-blocking" not in codes(run(topo(NVSWITCH), tmp_path, {"CUDA_LAUNCH_BLOCKING": "0"}))


def test_forced_algo_and_proto_in_the_calling_environment_warn(tmp_path: Path) -> None:
    findings = run(topo(NVSWITCH), tmp_path, {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"})
    assert one(findings, "forced-algo").severity == "warning"
    assert "NCCL_PROTO=Simple in the environment forces" in one(findings, "forced-proto").message
    # From nccl.conf it is the node's own choice, not the calling environment's.
    conf = conf_file(tmp_path, "NCCL_ALGO=Ring\n")
    assert "forced-algo" not in codes(run(topo(NVSWITCH), tmp_path, conf=[conf]))
    # LL128 is said once, by the LL128 finding.
    assert "forced-proto" not in codes(run(topo(NVSWITCH), tmp_path, {"NCCL_PROTO": "LL128"}))


def test_a_published_algo_in_the_environment_is_the_tuning_not_a_finding(tmp_path: Path) -> None:
    t = topo(NVSWITCH)
    publish_for(t, tmp_path / "pub", {"NCCL_ALGO": "Ring"})
    findings = run(t, tmp_path, {"NCCL_ALGO": "Ring"}, publish_dir=tmp_path / "pub")
    assert "forced-algo" not in codes(findings)


def test_ib_disable_with_rdma_nics_is_one_finding(tmp_path: Path) -> None:
    f = one(run(topo("dgx-a100-8gpu"), tmp_path, {"NCCL_IB_DISABLE": "1"}), "ib-disabled")
    assert f.severity == "warning" and "mlx5_0" in f.message
    assert "ib-disabled" not in codes(run(topo(NVSWITCH), tmp_path, {"NCCL_IB_DISABLE": "1"}))


def test_problems_of_several_gpus_are_one_line_each(tmp_path: Path) -> None:
    def narrow_and_down(snap: dict[str, Any]) -> None:
        for gpu in snap["nvml"]["gpus"]:
            gpu["pcie_cur_width"] = 8
            gpu["nvlinks"][0]["active"] = False
    t = load_topology(str(_edited(tmp_path, NVSWITCH, narrow_and_down)))
    findings = run(t, tmp_path)
    width = one(findings, "pcie-width")
    assert "GPU0 (" in width.message and "GPU1 (" in width.message
    down = one(findings, "nvlink-inactive")
    assert "GPU0 (" in down.message and "GPU1 (" in down.message
    slow = one(run(topo(PCIE_ONLY), tmp_path), "pcie-gen")  # the four GPUs were recorded idle, at Gen1
    assert slow.message.startswith("GPU0, GPU1, GPU2, GPU3 link at PCIe Gen1 of Gen4")


def test_a_misspelt_nccl_variable_is_named_with_the_one_meant(tmp_path: Path) -> None:
    conf = conf_file(tmp_path, "NCCL_SOCKET_NTHREAD=4\nNCCL_IB_HCA=mlx5\n")
    got = run(topo(NVSWITCH), tmp_path, env={"NCCL_MIN_NCHANNELZ": "16", "NCCL_ALGO": "Ring", "PATH": "/bin",
                                             "NCCL_SHARP_DISABLE": "1"}, conf=[conf])
    unknown = [f for f in got if f.code == "unknown-variable"]
    assert [f.message.split(" ")[0] for f in unknown] == ["NCCL_MIN_NCHANNELZ", "NCCL_SOCKET_NTHREAD"]
    assert unknown[0].severity == "warning"
    assert unknown[0].message.endswith("did you mean NCCL_MIN_NCHANNELS?")
    assert f"(from {conf})" in unknown[1].message and unknown[1].fix == "rename it to NCCL_SOCKET_NTHREADS"


@pytest.mark.parametrize(("value", "matches"), [
    ("eth", True), ("=eth", False), ("=eth0", True), ("ens,ib", True), ("ens", False),
    ("^lo,docker", True), ("^lo,docker,eth,ib", False), ("^=eth", True)])
def test_socket_ifname_is_read_as_nccl_reads_it(value: str, matches: bool) -> None:
    assert socket_ifname_matches(value, ["lo", "eth0", "ib0", "docker0"]) is matches


def test_a_socket_ifname_that_matches_no_interface_is_an_error(tmp_path: Path) -> None:
    import socket

    real = sorted(name for _i, name in socket.if_nameindex())
    assert "lo" in real
    got = run(topo(NVSWITCH), tmp_path, env={"NCCL_SOCKET_IFNAME": "=lo"})
    assert "socket-ifname-unmatched" not in codes(got)
    got = run(topo(NVSWITCH), tmp_path, env={"NCCL_SOCKET_IFNAME": "nosuchif"})
    finding = one(got, "socket-ifname-unmatched")
    assert finding.severity == "error" and "lo" in finding.message and "from the environment" in finding.message
