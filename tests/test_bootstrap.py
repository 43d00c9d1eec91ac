"""The chart's multi-node bootstrap, run for real: two network namespaces stand in for the leader
and the worker pod of a LeaderWorkerSet group, the worker runs a real sshd (Debian
openssh-server), the leader a real mpirun (Debian openmpi-bin).

What each "pod" gets is what Kubernetes would give it, taken from the rendered chart: the
ConfigMap's scripts at /opt/dflash-trt, the ssh Secret at /etc/dflash-trt/ssh (mode 0440), an
emptyDir at /tmp, the container's `env` list, the LWS controller's variables (LWS_LEADER_ADDRESS
<lws>-<group>.<subdomain>.<namespace>, LWS_GROUP_SIZE, LWS_WORKER_INDEX: kubernetes-sigs/lws
pkg/utils/pod/pod_utils.go @ 060ab4d), its pod name as host name, and names that resolve as the
LWS headless Service publishes them (a private /etc/hosts in each pod's mount namespace). The
scripts run unchanged except rank.sh's final serving command (after its `cd "$BUNDLE_DIR" &&`, for
trtllm-serve), replaced by a probe that records each rank's host, rank, working folder and
environment in its pod's /tmp. It runs for each server the chart launches under MPI: trtllm-serve
(the default) and Triton.

Needs root (namespaces), iproute2, util-linux unshare, openssh-server and openmpi-bin (`.ci/run`
installs the last two); otherwise the module skips, naming what is missing."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from helpers import netns_missing, objects

helm = pytest.importorskip("helm_python")

from dflash_trt.deploy.values import default_chart_dir

NAMESPACE = "serving"
RELEASE = "rel"
TOOLS = ("ip", "unshare", "mpirun", "orted", "ssh", "ssh-keygen", "/usr/sbin/sshd")
# Values of a TP16 group on two 8-GPU nodes, with every env-setting value turned on. The bundle is
# mounted under /opt (bind-mounted per pod below), so that trtllm-serve's `cd "$BUNDLE_DIR"` runs.
VALUES = {
    "gpu": {"count": 8, "product": "NVIDIA-B300-SXM6-AC"},
    "parallel": {"tp": 16, "pp": 1, "ep": 1},
    "bundle": {"models": [], "mountPath": "/opt/bundle", "pvc": {"accessModes": ["ReadWriteMany"]}},
    "multiNode": {"sshSecret": "dflash-trt-ssh", "image": {"repository": "registry.example.com/dflash-trt-trtllm-mpi",
                                                           "tag": "1.4.0rc4", "engineVersion": "1.4.0rc4"},
                  "workerWaitSeconds": 12},
    "rdma": {"enabled": True, "ibHca": "=mlx5_0"},
    "nccl": {"socketIfname": "veth-dft"},
    "triton": {"env": [{"name": "DFLASH_TEST_MARK", "value": "forwarded to every rank"}]},
}
PROBE = ("exec python3 -c 'import json, os, socket; r = os.environ[\"OMPI_COMM_WORLD_RANK\"]; "
         "os.makedirs(\"/tmp/probe\", exist_ok=True); "
         "json.dump({\"host\": socket.gethostname(), \"rank\": int(r), \"cwd\": os.getcwd(), \"env\": dict(os.environ)}, "
         "open(\"/tmp/probe/rank-\" + r + \".json\", \"w\")); print(\"probe rank\", r, socket.gethostname())'")
# The image keeps Open MPI off sshd's default PATH, as the Triton image does (HPC-X under
# /opt/hpcx/ompi): here /opt/ompi/bin holds mpirun and orted, and the system orted is hidden.
OMPI_BIN = "/opt/ompi/bin"
POD_PATH = f"{OMPI_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "not root: network and mount namespaces need root"
    absent = [t for t in TOOLS if not shutil.which(t)]
    if absent:
        return f"missing {', '.join(absent)} (apt-get install openmpi-bin openssh-server; .ci/run does)"
    return netns_missing()


pytestmark = pytest.mark.skipif(bool(_missing()), reason=_missing() or "")


def render_group(values: dict) -> dict:
    """The rendered LWS, its scripts, and the env lists of its leader and worker containers."""
    with helm.Chart.load(str(default_chart_dir())) as chart:
        objs = objects(chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True))
    (lws,) = [o for o in objs if o["kind"] == "LeaderWorkerSet"]
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    services = [o["metadata"]["name"] for o in objs if o["kind"] == "Service"]
    tpl = lws["spec"]["leaderWorkerTemplate"]
    env = {role: {e["name"]: e["value"] for e in tpl[f"{role}Template"]["spec"]["containers"][0]["env"]}
           for role in ("leader", "worker")}
    secret_keys = {role: [i["key"] for v in tpl[f"{role}Template"]["spec"]["volumes"] if v["name"] == "ssh"
                          for i in v["secret"]["items"]] for role in ("leader", "worker")}
    return {"lws": lws, "scripts": cm["data"], "env": env, "services": services, "secret_keys": secret_keys}


SERVERS = {"triton": "exec trtllm-llmapi-launch tritonserver ",
           "trtllm-serve": 'cd "$BUNDLE_DIR" && exec trtllm-llmapi-launch trtllm-serve target --config '}


def server_values(server: str) -> dict:
    models = ["tensorrt_llm"] if server == "triton" else []
    return {**VALUES, "server": {"stack": server}, "bundle": {**VALUES["bundle"], "models": models}}


def probe_rank_script(rank_sh: str, server: str) -> str:
    """rank.sh with its final serving command (what follows `exec`) replaced by the probe."""
    lines = rank_sh.rstrip("\n").split("\n")
    assert lines[-1].startswith(SERVERS[server]), lines[-1]
    return "\n".join(lines[:-1] + [lines[-1][:lines[-1].index("exec ")] + PROBE]) + "\n"


class Group:
    """Two namespaced "pods" of one LWS group, torn down (every process, both namespaces) on close."""

    def __init__(self, root: Path, rendered: dict, scripts: dict):
        self.root, self.rendered = root, rendered
        lws = rendered["lws"]
        self.lws_name = lws["metadata"]["name"]
        self.size = lws["spec"]["leaderWorkerTemplate"]["size"]
        subdomain = self.lws_name     # networkConfig.subdomainPolicy Shared: the LWS name
        leader_pod = f"{self.lws_name}-0"
        self.pods = {"leader": leader_pod, "worker": f"{leader_pod}-1"}
        self.fqdn = {role: f"{pod}.{subdomain}.{NAMESPACE}" for role, pod in self.pods.items()}
        tag = f"{os.getpid() % 10000}{random.randint(0, 99)}"
        self.ns = {"leader": f"dftl{tag}", "worker": f"dftw{tag}"}
        net = random.randint(0, 254)
        self.ip = {"leader": f"10.231.{net}.1", "worker": f"10.231.{net}.2"}
        self.procs: list[subprocess.Popen] = []
        self._net()
        key = root / "key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        for role in self.pods:
            d = root / role
            for sub in ("etc-up/dflash-trt/ssh", "etc-work", "opt/dflash-trt", "opt/bundle", "tmp"):
                (d / sub).mkdir(parents=True)
            (d / "etc-up/hosts").write_text(self.hosts_file(role))
            secret = d / "etc-up/dflash-trt/ssh"
            files = {"id_ed25519": key, "authorized_keys": key.with_suffix(".pub")}
            for name in rendered["secret_keys"][role]:     # the Secret items the pod mounts
                shutil.copy(files[name], secret / name)
            for f in secret.iterdir():
                f.chmod(0o440)                       # the Secret volume's defaultMode 288
            (d / "opt/ompi/bin").mkdir(parents=True)
            shutil.copy(Path(os.path.realpath(shutil.which("mpirun"))), d / "opt/ompi/bin/mpirun")
            shutil.copy(Path(os.path.realpath(shutil.which("orted"))), d / "opt/ompi/bin/orted")
            for name, text in scripts.items():
                (d / "opt/dflash-trt" / name).write_text(text)
                (d / "opt/dflash-trt" / name).chmod(0o555)
            (d / "tmp").chmod(0o1777)

    def hosts_file(self, role: str) -> str:
        """Name resolution as a pod has it: kubelet's /etc/hosts (its own short name and FQDN),
        and cluster DNS, which answers <pod>.<subdomain>.<namespace>[.svc.cluster.local] for every
        pod of the headless Service (the search path adds the suffix) but no other pod's short name."""
        own = f"{self.ip[role]} {self.fqdn[role]}.svc.cluster.local {self.pods[role]}\n"
        dns = "".join(f"{self.ip[r]} {self.fqdn[r]}\n" for r in self.pods)
        return "127.0.0.1 localhost\n" + own + dns

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def _net(self) -> None:
        for ns in self.ns.values():
            self._ip("netns", "add", ns)
        veth_l, veth_w = f"{self.ns['leader']}v", f"{self.ns['worker']}v"
        self._ip("link", "add", veth_l, "netns", self.ns["leader"], "type", "veth", "peer", "name", veth_w,
                 "netns", self.ns["worker"])
        for role, veth in (("leader", veth_l), ("worker", veth_w)):
            ns = self.ns[role]
            self._ip("-n", ns, "addr", "add", f"{self.ip[role]}/24", "dev", veth)
            self._ip("-n", ns, "link", "set", veth, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")

    def pod_env(self, role: str, extra: dict | None = None) -> dict:
        """The container's environment: the chart's env list, the LWS controller's variables, PATH."""
        env = dict(self.rendered["env"][role])
        env.update({"LWS_LEADER_ADDRESS": self.fqdn["leader"], "LWS_GROUP_SIZE": str(self.size),
                    "LWS_WORKER_INDEX": "0" if role == "leader" else "1", "PATH": POD_PATH})
        env.update(extra or {})
        return env

    def command(self, role: str, script: str, env: dict) -> list[str]:
        """Run /opt/dflash-trt/<script> in the role's pod: its network namespace, a private mount
        namespace (hosts file, Secret, scripts, /tmp), its pod name as host name, only its env."""
        d = self.root / role
        setup = " && ".join([
            f"mount -t overlay overlay -o lowerdir=/etc,upperdir={d}/etc-up,workdir={d}/etc-work /etc",
            f"mount --bind {d}/opt /opt",
            f"mount --bind /dev/null {os.path.realpath(shutil.which('orted'))}",   # not on sshd's PATH
            "mount -t tmpfs tmpfs /run", "mkdir -p /run/sshd",   # sshd started as root wants it
            f"mount --bind {d}/tmp /tmp",
            f"hostname {self.pods[role]}",
            "exec env -i " + " ".join(f"{k}='{v}'" for k, v in env.items()) + f" /bin/sh /opt/dflash-trt/{script}",
        ])
        return ["ip", "netns", "exec", self.ns[role], "unshare", "--mount", "--uts", "--fork", "sh", "-c", setup]

    def start_worker(self) -> subprocess.Popen:
        p = subprocess.Popen(self.command("worker", "worker.sh", self.pod_env("worker")), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        return p

    def run_leader(self, timeout: float) -> subprocess.CompletedProcess:
        # mpirun refuses root unless told; the pods run it as uid 1000 (podSecurityContext).
        env = self.pod_env("leader", {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
        return subprocess.run(self.command("leader", "leader.sh", env), check=False, capture_output=True, text=True,
                              timeout=timeout)

    def kill(self, role: str) -> None:
        """Kill every process of a pod's network namespace (sshd, its sessions, orted)."""
        pids = subprocess.run(["ip", "netns", "pids", self.ns[role]], check=False, capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        for p in self.procs:
            if p.poll() is None and role == "worker":
                p.wait(timeout=10)

    def close(self) -> None:
        for role in self.ns:
            self.kill(role)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)

    def probes(self, role: str) -> dict[int, dict]:
        out = {}
        for f in sorted((self.root / role / "tmp" / "probe").glob("rank-*.json")):
            d = json.loads(f.read_text())
            out[d["rank"]] = d
        return out


@pytest.fixture(params=sorted(SERVERS))
def group(tmp_path, request):
    rendered = render_group(server_values(request.param))
    scripts = dict(rendered["scripts"], **{"rank.sh": probe_rank_script(rendered["scripts"]["rank.sh"], request.param)})
    g = Group(tmp_path, rendered, scripts)
    g.server = request.param
    try:
        yield g
    finally:
        g.close()


def test_every_rank_starts_on_both_nodes_with_the_charts_environment(group):
    # The chart's own Services never take the LWS name (else LWS skips its headless Service).
    assert group.lws_name not in group.rendered["services"]
    worker = group.start_worker()
    r = group.run_leader(timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out + "\n--- worker:\n" + (worker.stdout.read() if worker.poll() is not None else "")
    world = VALUES["parallel"]["tp"]
    per_node = VALUES["gpu"]["count"]
    leader_ranks, worker_ranks = group.probes("leader"), group.probes("worker")
    # Ranks by slot: 0..7 on the leader's node, 8..15 on the worker's, each in that pod.
    assert sorted(leader_ranks) == list(range(per_node)), out
    assert sorted(worker_ranks) == list(range(per_node, world)), out
    chart_env = group.rendered["env"]["leader"]
    assert {"DFLASH_TEST_MARK", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "BUNDLE_DIR", "HOME",
            "OMPI_MCA_orte_keep_fqdn_hostnames"} <= set(chart_env)
    for ranks, pod in ((leader_ranks, group.pods["leader"]), (worker_ranks, group.pods["worker"])):
        for rank, probe in ranks.items():
            assert probe["host"] == pod
            # trtllm-serve runs from the bundle root, where its config's relative paths resolve
            if group.server == "trtllm-serve":
                assert probe["cwd"] == "/opt/bundle", probe["cwd"]
            assert probe["env"]["OMPI_COMM_WORLD_SIZE"] == str(world)
            # Every variable the chart sets reaches every rank with the chart's value.
            wrong = {k: probe["env"].get(k) for k, v in chart_env.items() if probe["env"].get(k) != v}
            assert not wrong, (rank, pod, wrong)
    assert f"worker {group.fqdn['worker']} answers on ssh port 2222" in out


def test_without_fqdn_host_names_mpirun_fails(group):
    # The oracle can fail: drop the keep-FQDN settings and mpirun cuts the worker's name at the
    # first dot, a name nothing resolves, so the ranks never start there.
    for role in ("leader", "worker"):
        leader_sh = group.root / role / "opt/dflash-trt/leader.sh"
        text = leader_sh.read_text()
        assert "--mca orte_keep_fqdn_hostnames 1 " in text
        leader_sh.write_text(text.replace("--mca orte_keep_fqdn_hostnames 1 ", ""))
        group.rendered["env"][role].pop("OMPI_MCA_orte_keep_fqdn_hostnames")
    group.start_worker()
    r = group.run_leader(timeout=180)
    assert r.returncode != 0
    assert f"Could not resolve hostname {group.pods['worker']}:" in r.stderr, r.stderr
    assert not group.probes("worker")


def test_without_prefix_orted_is_not_found_on_the_worker(group):
    # The oracle can fail: without --prefix, orted on the worker starts with sshd's environment,
    # whose PATH has no Open MPI, so no rank starts there.
    leader_sh = group.root / "leader/opt/dflash-trt/leader.sh"
    text = leader_sh.read_text()
    assert '--prefix "$prefix" ' in text
    leader_sh.write_text(text.replace('--prefix "$prefix" ', ""))
    group.start_worker()
    r = group.run_leader(timeout=180)
    assert r.returncode != 0 and not group.probes("worker"), r.stdout + r.stderr
    assert "ORTE was unable to reliably start one or more daemons" in r.stderr, r.stderr


def test_leader_fails_with_a_clear_line_when_a_worker_is_gone(group):
    worker = group.start_worker()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (group.root / "worker/tmp/sshd/sshd.pid").exists():
        time.sleep(0.2)
    assert worker.poll() is None
    group.kill("worker")                              # the worker's sshd dies
    wait = VALUES["multiNode"]["workerWaitSeconds"]
    t0 = time.monotonic()
    r = group.run_leader(timeout=wait + 60)           # no hang: it gives up after workerWaitSeconds
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    assert (f"dflash-trt: worker {group.fqdn['worker']} did not answer on ssh port 2222 within {wait} s"
            in r.stderr), r.stderr
    assert f"waiting for worker {group.fqdn['worker']}" in r.stdout
    assert wait <= took < wait + 40
    assert not group.probes("leader") and not group.probes("worker")


METRICS_SERVER = """
import http.server, pathlib, sys
page, port, path = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != path:
            self.send_response(404); self.end_headers(); return
        body = page.read_bytes()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
BUSY = ('# HELP nv_inference_pending_request_count Instantaneous number of pending requests\n'
        'nv_inference_pending_request_count{model="tensorrt_llm",version="1"} 0\n'
        'dflash_requests_active{model="tensorrt_llm",version="1"} 2\n'
        'dflash_requests_waiting{model="tensorrt_llm",version="1"} 1\n')
# trtllm-serve's /prometheus/metrics (its gauges: engines.json endpoints.load_metrics)
BUSY_TRTLLM = ('# TYPE trtllm_num_requests_running gauge\ntrtllm_num_requests_running 2.0\n'
               '# TYPE trtllm_num_requests_waiting gauge\ntrtllm_num_requests_waiting 1.0\n')
DRAINS = {  # server -> (extra values, metrics port, path, busy page)
    "triton": ({"server": {"stack": "triton"}, "bundle": {"models": ["tensorrt_llm"]},
                "image": {"repository": "registry.example.com/dflash-trt-triton", "tag": "1", "engineVersion": "1.4.0rc4"}},
               8002, "/metrics", BUSY),
    "trtllm-serve": ({}, 8000, "/prometheus/metrics", BUSY_TRTLLM),
}


@pytest.mark.parametrize("server", sorted(DRAINS))
@pytest.mark.parametrize("drain_seconds,goes_idle", [(30, True), (8, False)])
def test_prestop_drain_waits_for_in_flight_requests(tmp_path, drain_seconds, goes_idle, server):
    """The rendered drain.sh against a pod's metrics endpoint (a server in a private network
    namespace, so the port is free): it waits while requests are in flight, returns once they
    reach 0, and never waits past shutdown.drainSeconds."""
    extra, port, path, busy = DRAINS[server]
    with helm.Chart.load(str(default_chart_dir())) as chart:
        objs = objects(chart.render({**extra, "shutdown": {"drainSeconds": drain_seconds}}, name=RELEASE,
                                    namespace=NAMESPACE, is_install=True))
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    (tmp_path / "drain.sh").write_text(cm["data"]["drain.sh"])
    page = tmp_path / "metrics"
    page.write_text(busy)
    ns = f"dftd{os.getpid() % 10000}{random.randint(0, 99)}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        server = subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-c", METRICS_SERVER, str(page), str(port), path])
        time.sleep(1)
        t0 = time.monotonic()
        drain = subprocess.Popen(["ip", "netns", "exec", ns, "/bin/sh", str(tmp_path / "drain.sh")],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if goes_idle:
            time.sleep(9)
            page.write_text(re.sub(r" [0-9.]+\n", " 0\n", busy))
        out, _ = drain.communicate(timeout=drain_seconds + 30)
        took = time.monotonic() - t0
        server.kill()
        server.wait()
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
    assert drain.returncode == 0, out
    assert "dflash-trt: drain: 3 request(s) in flight" in out
    if goes_idle:
        assert "dflash-trt: drain: no request in flight" in out and 9 <= took < 20, (took, out)
    else:
        assert "no request in flight" not in out and drain_seconds <= took < drain_seconds + 10, (took, out)
