"""The chart's CPU rollout (a --gpu none bundle) started as its pod starts it: the container command,
environment, volume mounts and ConfigMap scripts read from the rendered chart (`deploy --render`), run
with the real tritonserver here (the nvidia-pytriton wheel's, as tests/test_triton_server.py) in a
private mount + network namespace laid out as the pod's filesystem: the bundle volume at its mountPath,
the scripts ConfigMap, an emptyDir /tmp, and the image's /opt/tritonserver (its binary and Python
backend). The chart's image is the one deploy/triton-cpu.Dockerfile builds (dflash-trt installed; the
stock tritonserver image lacks it and the dflash_reference model could not import it). The oracle:
the served text equals `dflash-trt generate` of the same bundle's pair."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_trt.bundle.served import served_pair
from dflash_trt.paths import deploy_path
from dflash_trt.stacks.tritonserver.server import (
    _backend_dir,
    default_stub_env,
    pytriton_dist,
    server_environment,
)

from helpers import objects, run_cli, tritonserver_missing

PROMPT = "the quick brown fox"
HOST_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "usr", "etc", "work", "root", "sys", "dev")
PROBE = r"""
import json, subprocess, sys, time, urllib.request
import numpy as np
sys.path.insert(0, sys.argv[5])
from helpers import grpc_stream, infer_inputs
http, grpc, ready, prompt = sys.argv[1:5]
ready = json.loads(ready)   # the chart's readiness probe: {"httpGet": {"path": ...}} or {"exec": {"command": [...]}}


def is_ready():
    if "exec" in ready:
        return subprocess.run(ready["exec"]["command"], capture_output=True, timeout=30).returncode == 0
    return urllib.request.urlopen(f"http://127.0.0.1:{http}{ready['httpGet']['path']}", timeout=5).status == 200


deadline = time.time() + 240
while True:
    try:
        if is_ready():
            break
    except (OSError, subprocess.SubprocessError):
        pass
    if time.time() > deadline:
        sys.exit("not ready in 240 s")
    time.sleep(1)
inputs = infer_inputs(("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                      ("sampling_param_max_tokens", np.array([16], dtype=np.int32), "INT32"),
                      ("streaming", np.array([False]), "BOOL"))
responses, error = grpc_stream(f"127.0.0.1:{grpc}", "dflash_reference", inputs, 240)
if error is not None:
    sys.exit(f"request failed: {error}")
print(json.dumps({"text": responses[-1]["text_output"][0].decode()}))
"""


def _namespace_missing() -> str | None:
    if os.geteuid() != 0:
        return "not root: the pod's filesystem is laid out with mount namespaces"
    for tool in ("unshare", "chroot", "mount", "ip"):
        if not shutil.which(tool):
            return f"no {tool}"
    return None


def test_the_charts_cpu_container_serves_the_bundle(tmp_path):
    reason = tritonserver_missing() or _namespace_missing()
    if reason:
        pytest.skip(reason)
    from dflash_trt.models.tiny import make_tiny

    make_tiny("llama", tmp_path / "t", tmp_path / "d", seed=1)
    bundle = tmp_path / "bundle"
    code, _, err = run_cli("build", "--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"), "--arch",
                           "hopper", "--gpu", "none", "--quant", "none", "--out", str(bundle))
    assert code == 0, err
    code, _, err = run_cli("deploy", "--bundle", str(bundle), "--out", str(tmp_path / "deploy"), "--render")
    assert code == 0, err
    objs = objects({p.name: p.read_text() for p in (tmp_path / "deploy" / "manifests").glob("*.yaml")})
    pod = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    [c] = pod["containers"]

    # the image: the one deploy/triton-cpu.Dockerfile builds on the chart's stock base, with dflash-trt in it
    cpu = json.loads(deploy_path("helm", "dflash-trt", "engines.json").read_text())["cpu_reference"]
    assert c["image"] == f"{cpu['image']['repository']}:{cpu['image']['tag']}"
    dockerfile = deploy_path("triton-cpu.Dockerfile").read_text()
    assert f"ARG BASE={cpu['base']}" in dockerfile and f"dflash-trt-triton-cpu:{cpu['image']['tag']}" in dockerfile
    assert 'pip install --no-cache-dir "/src/dflash-trt[serve]"' in dockerfile and "import dflash_trt" in dockerfile

    # the pod's filesystem
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    scripts_cm = next(o for o in objs if o["kind"] == "ConfigMap"
                      and o["metadata"]["name"] == volumes["scripts"]["configMap"]["name"])
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    for name, body in scripts_cm["data"].items():
        (scripts / name).write_text(body)
    dist = pytriton_dist()
    backends = _backend_dir(tmp_path / "work", dist)
    image_bin = tmp_path / "image-bin"   # the image's /opt/tritonserver/bin
    image_bin.mkdir()
    (image_bin / "tritonserver").symlink_to(dist / "bin" / "tritonserver")
    root = tmp_path / "root"
    binds = [(Path("/") / d, root / d) for d in HOST_DIRS if (Path("/") / d).is_dir()
             and not (Path("/") / d).is_symlink()]
    links = [(os.readlink(Path("/") / d), root / d) for d in HOST_DIRS if (Path("/") / d).is_symlink()]
    binds += [(bundle, root / mounts["bundle"].lstrip("/")), (scripts, root / mounts["scripts"].lstrip("/")),
              (backends, root / "opt/tritonserver/backends"), (image_bin, root / "opt/tritonserver/bin")]
    mount, ip, chroot = (shutil.which(t) for t in ("mount", "ip", "chroot"))
    setup = ["set -e", f"{mount} --make-rprivate /"]
    for src, dst in binds:
        setup += [f"mkdir -p {shlex.quote(str(dst))}", f"{mount} --rbind {shlex.quote(str(src))} {shlex.quote(str(dst))}"]
    setup += [f"ln -s {shlex.quote(t)} {shlex.quote(str(dst))}" for t, dst in links]
    setup += [f"mkdir -p {root}/tmp {root}/proc", f"{mount} -t tmpfs tmpfs {root}/tmp",   # the emptyDir /tmp
              f"{mount} -t proc proc {root}/proc", f"{ip} link set lo up"]
    # this checkout, its env (the stub env inside it) and the base interpreter, wherever they lie (a clone under
    # /tmp is hidden by the emptyDir above): bound last
    for src in sorted({Path(__file__).resolve().parents[1], Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}):
        if src.parts[1] not in HOST_DIRS:
            dst = root / src.relative_to("/")
            setup += [f"mkdir -p {shlex.quote(str(dst))}", f"{mount} --rbind {shlex.quote(str(src))} {shlex.quote(str(dst))}"]

    env = server_environment(default_stub_env())
    env.update({e["name"]: e["value"] for e in c["env"]})
    env["PATH"] = f"{default_stub_env() / 'bin'}:/opt/tritonserver/bin:/usr/local/bin:/usr/bin:/bin"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    ready = json.dumps({k: v for k, v in c["readinessProbe"].items() if k in ("httpGet", "exec")})
    inside = (f"{shlex.join(c['command'])} > /tmp/server.log 2>&1 & server=$!; "
              f"{shlex.quote(sys.executable)} -c {shlex.quote(PROBE)} {ports['http']} {ports['grpc']} "
              f"{shlex.quote(ready)} {shlex.quote(PROMPT)} {shlex.quote(str(Path(__file__).parent))}; rc=$?; kill -INT $server; (sleep 60; kill -9 $server) & wait $server || true; "
              f"[ $rc = 0 ] || tail -30 /tmp/server.log >&2; exit $rc")
    script = "\n".join(setup + [f"exec {chroot} {shlex.quote(str(root))} /bin/sh -c {shlex.quote(inside)}"])
    # a private PID namespace too: whatever the server leaves (its Python-backend stub) ends with it
    r = subprocess.run(["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "sh", "-c", script],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    served = json.loads(r.stdout.strip().splitlines()[-1])["text"]
    # the oracle: `generate` on the pair dflash_reference loads (--quant none: the bundle's own), in its dtype
    dtype = yaml.safe_load((bundle / "triton/dflash_reference/1/model.yaml").read_text())["dtype"]
    t, d = served_pair(bundle)
    out = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "generate", "--target", str(t), "--drafter", str(d),
                          "-p", PROMPT, "--max-new-tokens", "16", "--dtype", dtype, "--json"],
                         capture_output=True, text=True, check=True)
    assert served == json.loads(out.stdout)["text"]
