"""`adapt`: a bundle's drafter fine-tuned on the traffic it serves, gated, written as a bundle revision.

    traffic (train/traffic.py) ──train part──▶ the target's greedy answers (train/data.py)
        ──▶ fine-tune FROM the bundle's drafter, with its own config (train/trainer.py)
        ──held-out part──▶ the gate: old vs new drafter with the bundle's served target (bench/runtime.py)
        ──pass──▶ a revision by the one packager (bundle/package.py), draft schedule re-planned from the
                  acceptance the gate measured

The run folder (default OUT.run, beside OUT) holds the answers, the training run and the gate's figures;
running the same command again continues it (answers already given are kept, training resumes from its
last checkpoint, a larger --steps trains on). It belongs to one traffic split: other traffic is refused.
Under torchrun every rank reads the traffic and trains its share; rank 0 answers, gates and writes.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_write_text
from dflash_trt.io.jsonio import read_json
from dflash_trt.io.manifest import MANIFEST_NAME, AdaptRecord, Manifest, sha256_file
from dflash_trt.models.config import load_drafter_config
from dflash_trt.models.draft_vocab import FILE as DRAFT_VOCAB_FILE
from dflash_trt.train.traffic import Traffic, read_traffic

# Default gate margin (docs/adapt.md): one to two paired standard errors of the held-out tau gain measured on the
# embedded pair's code traffic (5.5-10 % at 22 held-out prompts), so a drafter is not shipped on the luck of the split.
DEFAULT_MIN_GAIN = 0.10


@dataclass
class AdaptSettings:
    held_out: float = 0.2                 # share of the distinct prompts held out for the gate
    # steps, lr, answer_tokens: measured on the embedded pair's code traffic (docs/adapt.md): 234 train prompts gain
    # held-out tau +23.3 % at 600 steps with 128-token answers, +26.1 % at 1000 with 256; 118 over-fit at 1500
    steps: int = 1000
    lr: float = 6e-4
    blocks_per_step: int = 32
    labels: str = "teacher-forced"        # trainer.TrainConfig.labels
    distill_k: int = 8                    # --distill topk:K (0: CE only)
    max_new_tokens: int = 128             # the gate's decode length
    answer_tokens: int | None = None      # the target's answers (the training data); None: twice max_new_tokens
    min_gain: float = DEFAULT_MIN_GAIN
    max_bad_rows: int | None = None
    answer_engine: str = "auto"
    dtype: str = "auto"
    threads: int | None = 2
    seed: int = 0
    verbose: bool = False

    @property
    def answer_length(self) -> int:
        return self.answer_tokens or 2 * self.max_new_tokens


@dataclass
class Figures:
    """One drafter on the held-out prompts, decoded by the bundle's served target (bench/runtime.run_bench)."""
    tau: float
    acceptance: list[float]               # share of blocks accepting at least k drafted tokens, k = 1..B-1
    speedup: float
    lossless: bool
    match_rate: float
    prompts: int
    blocks: int
    tau_per_prompt: list[float]


@dataclass
class Gate:
    before: Figures
    after: Figures
    min_gain: float

    @property
    def gain(self) -> float:
        return self.after.tau / self.before.tau - 1

    @property
    def passed(self) -> bool:
        return self.after.lossless and self.after.tau >= self.before.tau * (1 + self.min_gain)

    @property
    def paired_se(self) -> float | None:
        """Standard error of the relative gain over prompts (paired): the noise the margin must clear."""
        d = [a - b for a, b in zip(self.after.tau_per_prompt, self.before.tau_per_prompt)]
        return statistics.stdev(d) / len(d) ** 0.5 / self.before.tau if len(d) > 1 else None

    def why(self) -> str:
        if not self.after.lossless:
            return "the new drafter's output differs from plain decoding (not lossless)"
        return (f"held-out tau {self.before.tau:.3f} -> {self.after.tau:.3f} ({self.gain:+.1%}), "
                f"{'at least' if self.passed else 'below'} --min-gain {self.min_gain:.1%}")

    def to_dict(self) -> dict:
        return {"min_gain": self.min_gain, "gain": self.gain, "paired_se": self.paired_se, "passed": self.passed,
                "before": asdict(self.before), "after": asdict(self.after)}


@dataclass
class AdaptResult:
    traffic: Traffic
    training: dict
    gate: Gate
    run_dir: str
    revision: str | None
    seconds: float

    def to_dict(self) -> dict:
        return {"revision": self.revision, "passed": self.gate.passed, "reason": self.gate.why(),
                "run_dir": self.run_dir, "seconds": self.seconds, "traffic": self.traffic.to_dict(),
                "training": self.training, "gate": self.gate.to_dict()}


def _log(line: str) -> None:
    print(f"adapt: {line}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ the pieces
def bundle_pair(bundle: Path, m: Manifest) -> tuple[Path, Path, Path]:
    """(served target, served drafter, the target the drafter trains on): the unquantized one (the bundle's
    own copy, or the source folder a quantized bundle was built from)."""
    from dflash_trt.bundle.served import served_pair

    target, drafter = served_pair(bundle)
    if m.quant.drafter != "none":
        raise DFlashError(f"{bundle}: the bundle's drafter is quantized ({m.quant.drafter}); adapt fine-tunes an "
                          "unquantized drafter: build the bundle with --drafter-quant none")
    if m.quant.target == "none":
        return target, drafter, target
    source = Path(m.target.path)
    if not (source / "config.json").is_file():
        raise DFlashError(f"{bundle}: the drafter trains on the unquantized target, {source} (manifest target.path), "
                          "which is not there")
    return target, drafter, source


def train_config(drafter: Path, s: AdaptSettings):
    """The trainer's config from the drafter's OWN config: the fine-tune changes weights, never shape."""
    from dflash_trt.train.trainer import TrainConfig

    cfg = load_drafter_config(drafter)
    if cfg.kind != "dflash":
        raise DFlashError(f"{drafter}: a {cfg.kind} drafter; adapt fine-tunes DFlash drafters")
    return TrainConfig(layers=cfg.num_hidden_layers, block_size=cfg.block_size,
                       intermediate_size=cfg.intermediate_size, target_layer_ids=list(cfg.target_layer_ids),
                       mask_token_id=cfg.mask_token_id, steps=s.steps, lr=s.lr, warmup=min(50, max(1, s.steps // 10)),
                       blocks_per_step=s.blocks_per_step, save_every=max(1, min(100, s.steps)), eval_every=0,
                       log_every=10, seed=s.seed, init_from=str(drafter), labels=s.labels, distill_k=s.distill_k,
                       draft_vocab=str(drafter) if (drafter / DRAFT_VOCAB_FILE).is_file() else None)


def claim_run_dir(run_dir: Path, traffic: Traffic, bundle: Path, answer_tokens: int) -> None:
    """The run folder is this traffic's, bundle's and answer length's: a fresh one is claimed, another's refused."""
    claim = {"bundle_manifest_sha256": sha256_file(bundle / MANIFEST_NAME), "traffic": traffic.fingerprint(),
             "answer_tokens": answer_tokens}
    path = run_dir / "adapt-run.json"
    if path.is_file():
        if read_json(path) != claim:
            raise DFlashError(f"--run-dir {run_dir}: holds a run for other traffic, another bundle or another "
                              "--answer-tokens; give another --run-dir (or remove that one)")
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(claim, indent=2) + "\n")


def answer(train_target: Path, traffic: Traffic, run_dir: Path, s: AdaptSettings, progress: bool) -> Path:
    """The target's greedy answers to the train part (resumable: train/data.py generate_responses). Rows are
    keyed by the prompt's hash, so the run folder holds token ids, not the prompts' text."""
    from dflash_trt.train.data import generate_responses

    return generate_responses(train_target, [r.key for r in traffic.train], run_dir / "answers.jsonl",
                              max_new_tokens=s.answer_length, progress=progress, threads=s.threads, dtype=s.dtype,
                              engine=s.answer_engine, prompt_ids={r.key: r.ids for r in traffic.train})


def measure(target: Path, old: Path, new: Path, prompts: list[list[int]], s: AdaptSettings,
            progress: bool) -> tuple[Figures, Figures]:
    """Old and new drafter with the served target on the held-out prompts: tau, acceptance per position,
    speed-up and token identity to plain decoding (bench's interleaved runs; one AR run per prompt serves both)."""
    from dflash_trt.bench.runtime import run_bench
    from dflash_trt.plan.draft_schedule import survival_from_histogram
    from dflash_trt.runtime.pair import load_pair

    # the new drafter's pair goes at once (its target with it): one target in memory while both drafters decode
    new_drafter = load_pair(target, new, s.dtype).drafter
    r = run_bench(load_pair(target, old, s.dtype), prompts, max_new_tokens=s.max_new_tokens, progress=progress,
                  also={"new": new_drafter})

    def figures(r: dict, drafter: Path) -> Figures:
        if not r["blocks"]:
            raise DFlashError(f"{drafter}: no draft block decoded on the held-out prompts (every answer ends at once)")
        return Figures(tau=r["tau"], acceptance=survival_from_histogram(r["acceptance_histogram"], r["block_size"]),
                       speedup=r["speedup"], lossless=bool(r["lossless"]), match_rate=r["match_rate"],
                       prompts=r["n_prompts"], blocks=r["blocks"],
                       tau_per_prompt=[p["tau"] or 1.0 for p in r["per_prompt"]])

    return figures(r, old), figures(r["also"]["new"], new)


def gated(target: Path, drafter: Path, run: Path, traffic: Traffic, s: AdaptSettings, progress: bool, log) -> Gate:
    """The gate's figures: measured, or read back from the run folder when they were measured on these very
    drafters, target and held-out prompts (greedy decoding gives the same tau again; only --min-gain is
    applied afresh), so re-running a refused run with another --min-gain costs no decoding."""
    from dflash_trt.io.manifest import HashCache

    new, hashes = run / "train" / "drafter", HashCache()
    key = {"target": hashes.tree(target), "old": hashes.tree(drafter), "new": hashes.tree(new),
           "held_out": [r.key for r in traffic.held_out], "max_new_tokens": s.max_new_tokens, "dtype": s.dtype}
    saved = read_json(run / "gate.json") if (run / "gate.json").is_file() else {}
    if saved.get("measured_on") == key:
        log(f"gate: the figures of {run / 'gate.json'} (measured on these drafters and held-out prompts)")
        return Gate(Figures(**saved["before"]), Figures(**saved["after"]), s.min_gain)
    log(f"gate: old and new drafter on {len(traffic.held_out)} held-out prompts with the served target {target}")
    prompts = [r.ids for r in traffic.held_out]
    gate = Gate(*measure(target, drafter, new, prompts, s, progress), s.min_gain)
    atomic_write_text(run / "gate.json", json.dumps(gate.to_dict() | {"measured_on": key}, indent=2) + "\n")
    return gate


def replanned_schedule(bundle: Path, m: Manifest, drafter: Path, acceptance: list[float]):
    """The draft schedule from the acceptance the gate measured and the bundle's own cost model (its GPU
    node, the layout its plan.json records); None for a CPU bundle (no cost model: the parent's schedule, if
    any, stays)."""
    from dflash_trt.deploy.values import plan_for_bundle
    from dflash_trt.plan import draft_schedule as ds
    from dflash_trt.plan import tune

    if not m.gpu:
        return None
    cost = tune.bundle_step_cost(m, load_drafter_config(drafter).raw, plan_for_bundle(bundle, manifest=m))
    return ds.choose(acceptance, cost.step_seconds, cost.concurrencies, max_k=len(acceptance), assumptions=[
        "acceptance per position measured by `dflash-trt adapt` on held-out served traffic with the bundle's "
        "served target", cost.source])


def write_adapted(bundle: Path, out: Path, m: Manifest, traffic: Traffic, training: dict, drafter: Path,
                  gate: Gate) -> None:
    """The revision, through the one packager: the new drafter, and the schedule re-planned from the gate."""
    from dflash_trt.bundle.package import RevisionChange, write_revision

    record = AdaptRecord(traffic=traffic.files, rows={k: v for k, v in traffic.to_dict().items() if k != "files"},
                         training=training, gate=gate.to_dict(),
                         adapted=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    schedule = replanned_schedule(bundle, m, drafter, gate.after.acceptance)
    write_revision(bundle, out, RevisionChange(
        kind="adapt", summary=f"drafter fine-tuned on {record.rows['train']} served prompts: {gate.why()}",
        record=record, drafter=drafter, draft_schedule=schedule,
        schedule_source=f"adapt: re-planned from the acceptance measured on {gate.after.prompts} held-out prompts "
                        f"(tau {gate.after.tau:.2f})" if schedule else None))


# ------------------------------------------------------------------------------------ the stage
def adapt(bundle: str | Path, traffic_paths: list[str | Path], out: str | Path, s: AdaptSettings, *,
          run_dir: str | Path | None = None, progress: bool = True, log=_log) -> AdaptResult | None:
    """Read, answer, fine-tune, gate, write (module docstring). Returns None on ranks other than 0; a
    refused gate is a result with revision None (the caller exits non-zero)."""
    from transformers import AutoTokenizer

    from dflash_trt.train.distributed import close_world, init_world
    from dflash_trt.train.trainer import train_drafter

    t0 = time.perf_counter()
    bundle, out = Path(bundle).resolve(), Path(out)
    _check_out(bundle, out)
    m = Manifest.read(bundle)
    target, drafter, train_target = bundle_pair(bundle, m)
    tc = train_config(drafter, s)
    context = int(read_json(target / "config.json").get("max_position_embeddings") or 4096)
    run = Path(run_dir) if run_dir else Path(str(out) + ".run")
    world = init_world()
    log = log if world.main else (lambda line: None)   # every rank reads the traffic; rank 0 speaks
    try:
        traffic = read_traffic(traffic_paths, AutoTokenizer.from_pretrained(str(target)),
                               max_prompt_tokens=context - max(s.max_new_tokens, s.answer_length) - tc.block_size,
                               held_out_fraction=s.held_out, max_bad_rows=s.max_bad_rows, verbose=s.verbose, log=log)
        log(f"{traffic.rows} rows in {len(traffic.files)} files: {len(traffic.train)} train, {len(traffic.held_out)} "
            f"held out ({s.held_out:.0%} by prompt hash), {traffic.duplicates} duplicates, {len(traffic.skipped)} "
            f"skipped ({traffic.skipped_summary()})")
        if world.main:
            claim_run_dir(run, traffic, bundle, s.answer_length)
            answer(train_target, traffic, run, s, progress)
        world.barrier("waiting for rank 0 to answer the traffic")
        resume = (run / "train" / "state" / "state.json").is_file()
        log(("resuming" if resume else "fine-tuning") + f" {drafter.name} ({tc.layers} layers, block {tc.block_size}, "
            f"target layers {tc.target_layer_ids}) for {s.steps} steps in {run / 'train'}")
        training = train_drafter(train_target, run / "answers.jsonl", run / "train", tc, resume=resume,
                                 progress=progress, max_new_tokens=s.answer_length, threads=s.threads, dtype=s.dtype,
                                 world=world)
    finally:
        close_world(world)
    if not world.main:
        return None
    gate = gated(target, drafter, run, traffic, s, progress, log)
    losses = [json.loads(x)["loss"] for x in (run / "train" / "log.jsonl").read_text().splitlines()] \
        if (run / "train" / "log.jsonl").is_file() else []   # the whole run's, whichever session trained it
    training = {k: training[k] for k in ("step", "train_seconds", "n_sequences", "n_tokens", "world_size")} | {
        "logged_loss_first": losses[0] if losses else None, "logged_loss_last": losses[-1] if losses else None,
        "labels": s.labels, "distill_k": s.distill_k, "lr": s.lr, "answer_tokens": s.answer_length,
        "init_from": str(drafter)}
    if gate.passed:
        write_adapted(bundle, out, m, traffic, training, run / "train" / "drafter", gate)
    return AdaptResult(traffic, training, gate, str(run), str(out) if gate.passed else None,
                       time.perf_counter() - t0)


def _check_out(bundle: Path, out: Path) -> None:
    if out.resolve() == bundle or out.resolve().is_relative_to(bundle):
        raise DFlashError(f"--out {out}: inside the bundle; write the revision to a new folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DFlashError(f"--out {out}: exists and is not empty")
