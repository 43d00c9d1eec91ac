"""`doctor`: the node check before rollout (bench/doctor.py)."""
from __future__ import annotations

import click

from dflash_trt.commands.core import emit_json
from dflash_trt.errors import DFlashError


@click.command("doctor")
@click.option("--bundle", type=click.Path(file_okay=False, exists=True), help="Also check the node against this bundle "
              "(its GPU and SM).")
@click.option("--require-gpu", is_flag=True, help="A check that could not run (no GPU, no driver) fails too: for the "
              "chart's init step on a GPU node.")
@click.option("--json", "as_json", is_flag=True)
def doctor_cmd(bundle, require_gpu, as_json):
    """Check this node before a rollout: the NVIDIA driver and CUDA (torch runs a kernel on the GPU), that
    the bundle's GPU is the node's, that the KV-injection plugin compiles to a cubin for the node's SM and
    the driver loads it, that the Triton KV-injection kernel on CUDA equals the reference, and that the
    runtime decodes a tiny pair losslessly (DFlash == AR) on the CPU and on CUDA. Each check says ok,
    fail, or not run and why (on a CPU machine the CUDA checks are not run). Exit 1 if any check fails
    (with --require-gpu, also if any was not run).

    \b
    Examples:
      dflash-trt doctor
      dflash-trt doctor --bundle engines/gpt-oss-120b-blackwell --json
    """
    from dflash_trt.bench.doctor import FAIL, NOT_RUN, run_doctor

    def line(r):
        if not as_json:
            click.echo(f"{r.status:>7}  {r.name:<15} {r.detail}  ({r.seconds:.1f} s)")

    report = run_doctor(bundle, progress=line)
    bad = [c for c in report["checks"] if c["status"] == FAIL or (require_gpu and c["status"] == NOT_RUN)]
    report["ok"] = not bad
    if as_json:
        emit_json(report)
    else:
        c = report["counts"]
        click.echo(f"doctor: {c['ok']} ok, {c['fail']} failed, {c['not run']} not run")
    if bad:
        raise DFlashError(f"doctor: {', '.join(c['name'] for c in bad)} "
                          + ("failed" if all(c["status"] == FAIL for c in bad) else "failed or could not run"))
