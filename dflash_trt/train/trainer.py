"""Training a DFlash drafter for a (small) target: the public recipe (docs/decode-loop.md).

    prompts ──target generates──▶ responses (JSONL) ──target forward──▶ feature shards on disk (bf16)
            ──▶ random anchors, masked blocks, per-anchor attention, decayed CE ──▶ z-lab drafter

By stage: the data, the target's own greedy answers (train/data.py), its features (train/features.py), the
run's settings and the drafter's config and first weights (train/initial.py), the batches, loss and τ
estimate (train/objective.py); this module runs them (the setup, the steps, the resumable state) in one
process or on every rank of a torchrun job (train/distributed.py: each rank trains its share of the batch).

Run folder (--out DIR): DIR/drafter (the z-lab checkpoint, bfloat16, rewritten at every save),
DIR/state (fp32 weights + AdamW moments as safetensors, step and RNG as JSON: what --resume
reads), DIR/features (the target's feature shards), DIR/log.jsonl (loss and τ per log step).
Under torchrun DIR must be on storage every rank sees; rank 0 alone writes into it.
"""
from __future__ import annotations

import copy
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_output_dir
from dflash_trt.io.jsonio import read_json
from dflash_trt.models.drafter import DFlashDrafter, save_drafter
from dflash_trt.runtime.pair import resolve_dtype
from dflash_trt.train.data import Sequences, is_prompt_only, load_sequences, prepare_data
from dflash_trt.train.distributed import World, close_world, init_world
from dflash_trt.train.features import label_sequences
from dflash_trt.train.initial import RUN_SETTINGS, TrainConfig, choose_mask_token, drafter_config_for
from dflash_trt.train.initial import draft_vocabulary, initial_weights, settle
from dflash_trt.train.objective import FrozenTarget, block_loss_terms, default_gamma, estimate_tau, make_batch
from dflash_trt.train.objective import sample_picks, split_picks

CACHED_TOPK = 8


def save_state(run_dir: Path, drafter, opt, step: int, tc: TrainConfig, rng: random.Random, extra: dict) -> None:
    """Resume state: weights (fp32) and AdamW moments as safetensors, the rest as JSON. No pickle."""
    with atomic_output_dir(run_dir / "state") as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()},
                  str(tmp / "model.safetensors"))
        names = {id(p): n for n, p in drafter.named_parameters()}
        moments, steps = {}, {}
        for group in opt.param_groups:
            for p in group["params"]:
                if st := opt.state.get(p):
                    n = names[id(p)]
                    moments[f"exp_avg.{n}"] = st["exp_avg"].cpu().contiguous()
                    moments[f"exp_avg_sq.{n}"] = st["exp_avg_sq"].cpu().contiguous()
                    steps[n] = float(st["step"])
        save_file(moments or {"empty": torch.zeros(1)}, str(tmp / "optimizer.safetensors"))
        py_state = rng.getstate()
        (tmp / "state.json").write_text(json.dumps({
            "step": step, "train_config": asdict(tc), "drafter_config": drafter.config.to_dict(),
            "adam_steps": steps,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "python_rng": [py_state[0], list(py_state[1]), py_state[2]], **extra,
        }, indent=1) + "\n")


def load_state(run_dir: Path, drafter, opt) -> tuple[int, list, dict]:
    """The state save_state wrote, whatever world size wrote it: it is the replicated state of
    data parallelism, the same on every rank, so any number of ranks each read all of it."""
    sdir = run_dir / "state"
    meta = read_json(sdir / "state.json")
    drafter.load_state_dict(load_file(str(sdir / "model.safetensors")))
    moments = load_file(str(sdir / "optimizer.safetensors"))
    for n, p in drafter.named_parameters():
        if n in meta["adam_steps"]:
            opt.state[p] = {"step": torch.tensor(meta["adam_steps"][n]), "exp_avg": moments[f"exp_avg.{n}"].to(p.device),
                            "exp_avg_sq": moments[f"exp_avg_sq.{n}"].to(p.device)}
    for g, saved in zip(opt.param_groups, meta["param_groups"]):
        g.update(saved)
    return int(meta["step"]), meta["python_rng"], meta


@dataclass
class Run:
    """One training session: what setup builds, then the progress that each step advances and
    each save records."""
    out_dir: Path
    world: World
    tc: TrainConfig
    data: Sequences
    eval_data: Sequences | None
    drafter: DFlashDrafter
    frozen: FrozenTarget
    opt: torch.optim.AdamW
    rng: random.Random           # draws the anchors; saved, so a resumed run draws what a straight one would
    gamma: float
    target_dtype: torch.dtype
    init_notes: list[str]        # how the weights started, for the model card
    drafter_files: dict[str, bytes]  # written beside every saved drafter (its draft_vocab.json)
    step: int = 0
    elapsed_before: float = 0.0  # training seconds of the sessions before this one (--resume)
    t_start: float = 0.0         # time.perf_counter() when this session started training
    tau: float | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    loss_ema: float | None = None
    saved_at: int = -1           # the step last saved (the final save may fall on a periodic one)
    slots_seen: int = 0          # labelled draft slots trained on so far (the learning curve's x axis)
    labelling: dict | None = None  # what this session's labelling pass did (train/features.py)

    def seconds(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t_start


def learning_rate(tc: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine down to 10% of tc.lr at tc.steps."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    frac = min(1.0, (step - tc.warmup) / max(1, tc.steps - tc.warmup))
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _check_out_dir(out_dir: Path, resume: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume and not (out_dir / "state" / "state.json").is_file():
        raise DFlashError(f"{out_dir}/state/state.json: nothing to resume (no checkpoint saved yet)")
    if not resume and (out_dir / "state").exists():
        raise DFlashError(f"{out_dir}: already holds a training run; pass --resume to continue it or choose another --out")


def _load_data(target_dir: Path, path: str | Path, answers_path: Path, tokenizer, max_new_tokens: int,
               progress: bool, dtype: torch.dtype, world: World, engine: str = "auto") -> Sequences:
    """Sequences of a data JSONL; a prompt-only one is answered by the target first (into
    answers_path), on rank 0 while the others wait (vLLM batches the whole set on its own)."""
    if world.main:
        prepare_data(target_dir, Path(path), answers_path, max_new_tokens, progress, dtype, engine)
    world.barrier("waiting for rank 0 to answer the prompts")
    return load_sequences(answers_path if is_prompt_only(Path(path)) else path, tokenizer)[0]


def _setup(target_dir: Path, data_path: str | Path, out_dir: Path, tc: TrainConfig, *, eval_path, resume: bool,
           progress: bool, max_new_tokens: int, feature_cache, dtype: str, world: World, engine: str = "auto") -> Run:
    """Data and target features, the drafter and its optimizer; on --resume, the saved state."""
    from transformers import AutoTokenizer

    _check_out_dir(out_dir, resume)
    world.barrier("checking the run folder")   # nobody writes before every rank has looked at it
    if tc.blocks_per_step < world.size:
        raise DFlashError(f"--blocks-per-step {tc.blocks_per_step}: fewer blocks than the {world.size} ranks; each "
                          "rank needs at least one block per step")
    target_cfg = read_json(target_dir / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    if resume:  # the run's own settings win: a resumed run is the same run
        saved = read_json(out_dir / "state" / "state.json")["train_config"]
        for k in RUN_SETTINGS:
            setattr(tc, k, saved[k])
    else:
        settle(tc)   # what no flag gave: --init-from's drafter's, else the defaults

    target_dtype = resolve_dtype(dtype)
    data = _load_data(target_dir, data_path, out_dir / "data.jsonl", tokenizer, max_new_tokens, progress, target_dtype,
                      world, engine)
    if tc.mask_token_id is None:
        tc.mask_token_id = choose_mask_token(tokenizer, data.tokens)
    dcfg = drafter_config_for(target_cfg, tc, tc.mask_token_id)
    cache = Path(feature_cache) if feature_cache else out_dir / "features"
    # the cache keeps at least the top 8 whenever labels are needed (96 bytes a token beside 5.8 KB of
    # features), so runs with and without --distill share one labelling pass
    topk = max(tc.distill_k, CACHED_TOPK) if tc.labels == "teacher-forced" or tc.distill_k else 0
    labelling = label_sequences(target_dir, data, dcfg.target_layer_ids, cache, world, progress, target_dtype, topk)
    eval_data = None
    if eval_path is not None:
        eval_data = _load_data(target_dir, eval_path, out_dir / "eval_data.jsonl", tokenizer, max_new_tokens,
                               progress, target_dtype, world, engine)
        label_sequences(target_dir, eval_data, dcfg.target_layer_ids, cache, world, progress, target_dtype)

    torch.manual_seed(tc.seed)  # the drafter's random init
    longest = max(int((d.offsets[1:] - d.offsets[:-1]).max()) for d in (data, eval_data) if d is not None)
    drafter = DFlashDrafter(dcfg, max_len=longest + tc.block_size + 1)
    init_notes = [] if resume else initial_weights(drafter, tc, target_dir, target_cfg)
    draft_vocab, drafter_files = draft_vocabulary(tc, target_cfg)
    frozen = FrozenTarget(target_dir, target_cfg, draft_vocab, resolve_dtype(tc.train_dtype)).to(world.device)
    drafter.to(world.device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    # every rank draws the same anchors from one seeded RNG and trains on its share (split_picks)
    run = Run(out_dir, world, tc, data, eval_data, drafter, frozen, opt, random.Random(tc.seed),
              tc.gamma or default_gamma(tc.block_size), target_dtype, init_notes, drafter_files, labelling=labelling)
    if resume:
        run.step, py_rng, meta = load_state(out_dir, drafter, opt)
        run.rng.setstate((py_rng[0], tuple(py_rng[1]), py_rng[2]))
        run.elapsed_before = float(meta.get("train_seconds", 0.0))
        run.init_notes, run.tau = meta.get("init", []), meta.get("tau")
        run.slots_seen = int(meta.get("slots_seen", 0))
    return run


def _train_step(run: Run) -> None:
    """One optimisation step: the scheduled lr, a batch of random anchors (this rank's share of
    it), the decayed CE, gradients summed over the ranks, AdamW."""
    tc, world = run.tc, run.world
    for g in run.opt.param_groups:
        g["lr"] = learning_rate(tc, run.step)
    picks = split_picks(sample_picks(run.data, run.rng, tc.blocks_per_step, tc.anchors_per_seq), world)
    batch = make_batch(run.data, picks, tc.block_size, tc.mask_token_id, tc.labels, tc.distill_k)
    total, weight = block_loss_terms(run.drafter, run.frozen, batch, run.gamma)
    # the loss of the global batch = (sum of the ranks' weighted sums) / (sum of their weights); each
    # rank's gradient of total / global weight, summed over the ranks, is that loss's gradient
    sums = torch.stack([weight.detach().double(), total.detach().double(),
                        (batch.labels >= 0).sum().double().to(weight.device)])
    sums = world.all_reduce(sums, f"the loss all-reduce of step {run.step + 1}")
    run.slots_seen += int(sums[2])
    run.opt.zero_grad(set_to_none=True)
    loss = total / sums[0].float() if sums[0] > 0 else total
    loss.backward()
    if world.distributed:
        _all_reduce_grads(run.drafter, world, run.step + 1)
    torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), 1.0)
    run.opt.step()
    run.step += 1
    run.last_loss = float(sums[1] / sums[0]) if sums[0] > 0 else 0.0
    run.first_loss = run.last_loss if run.first_loss is None else run.first_loss
    run.loss_ema = run.last_loss if run.loss_ema is None else 0.95 * run.loss_ema + 0.05 * run.last_loss


def _all_reduce_grads(drafter, world: World, step: int) -> None:
    """Sum every parameter's gradient over the ranks, as one flat buffer (one collective)."""
    params = list(drafter.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    world.all_reduce(flat, f"the gradient all-reduce of step {step}")
    i = 0
    for p in params:
        n = p.numel()
        p.grad = flat[i:i + n].view_as(p)
        i += n


def _held_out_tau(run: Run) -> float:
    run.drafter.eval()
    tau = estimate_tau(run.drafter, run.frozen, run.eval_data, run.tc.eval_max_new_tokens,
                       max_seqs=run.tc.eval_max_seqs, world=run.world)["tau"]
    run.drafter.train()
    return tau


def _save(run: Run) -> None:
    """Checkpoint (at most once per step): the resume state, then the z-lab drafter (bf16), with
    a fresh τ when there is held-out data."""
    if run.saved_at == run.step:
        return
    run.saved_at = run.step
    if run.eval_data is not None:
        run.tau = _held_out_tau(run)
    # the replicas must agree before one of them is written as the run's state
    run.world.check_replicas(list(run.drafter.parameters()), f"the drafter weights at step {run.step}")
    if run.world.main:
        save_state(run.out_dir, run.drafter, run.opt, run.step, run.tc, run.rng,
                    {"train_seconds": run.seconds(), "tau": run.tau, "init": run.init_notes, "loss": run.last_loss,
                     "slots_seen": run.slots_seen, "world_size": run.world.size})
        drafter = run.drafter if run.world.device.type == "cpu" else copy.deepcopy(run.drafter).cpu()
        save_drafter(drafter, run.out_dir / "drafter", dtype=torch.bfloat16, extra_files=run.drafter_files)
    run.world.barrier(f"the checkpoint of step {run.step}")


def _log(run: Run) -> None:
    if not run.world.main:
        return
    with open(run.out_dir / "log.jsonl", "a") as f:
        f.write(json.dumps({"step": run.step, "loss": run.last_loss, "loss_ema": run.loss_ema,
                            "lr": learning_rate(run.tc, run.step - 1), "tau": run.tau, "seconds": run.seconds(),
                            "slots_seen": run.slots_seen}) + "\n")


def train_drafter(target_dir: str | Path, data_path: str | Path, out_dir: str | Path, tc: TrainConfig, *,
                  eval_path: str | Path | None = None, resume: bool = False, progress: bool = True,
                  max_new_tokens: int = 192, threads: int | None = 2, time_limit_s: float | None = None,
                  stop_after: int | None = None, feature_cache: str | Path | None = None,
                  dtype: str = "auto", world: World | None = None, answer_engine: str = "auto") -> dict:
    """Train (or continue training) a DFlash drafter for the target; returns a summary dict.
    The z-lab checkpoint is written to out_dir/drafter at every save and at the end.
    time_limit_s / stop_after end this session early (after a save); --resume continues it.
    `dtype` is the target's, for its answers and features: "auto" is the runtime's default
    (bfloat16 on CPUs with native bf16), so the drafter learns the target it will run with;
    bf16 also computed features 2.2x faster than float32 here.
    `world`: the process group (train/distributed.py); by default the one torchrun describes in the
    environment, else one process."""
    if threads:
        torch.set_num_threads(threads)
    own_world = world is None
    world = world or init_world()
    try:
        run = _setup(Path(target_dir), data_path, Path(out_dir), tc, eval_path=eval_path, resume=resume,
                     progress=progress, max_new_tokens=max_new_tokens, feature_cache=feature_cache, dtype=dtype,
                     world=world, engine=answer_engine)
        run.t_start = time.perf_counter()
        bar = tqdm(total=tc.steps, initial=run.step, unit="step", disable=not (progress and world.main),
                   desc="train-drafter" + (f" ({world.size} ranks)" if world.distributed else ""), file=sys.stderr,
                   dynamic_ncols=True)
        run.drafter.train()
        try:
            stopped_early = _loop(run, bar, time_limit_s, stop_after)
        finally:
            bar.close()   # an error line then starts on a line of its own
        _save(run)
        return _summary(run, stopped_early)
    finally:
        if own_world:
            close_world(world)


def _loop(run: Run, bar, time_limit_s, stop_after) -> bool:
    """Steps until tc.steps (or the time limit / stop_after: returns True then)."""
    tc, world = run.tc, run.world
    stopped_early = False
    while run.step < tc.steps:
        over = time_limit_s is not None and time.perf_counter() - run.t_start > time_limit_s
        if time_limit_s is not None and world.distributed:   # rank 0's clock decides for every rank
            flag = torch.tensor([float(over and world.main)], device=world.device)
            over = bool(world.all_reduce(flag, "the time-limit check") > 0)
        if over or (stop_after is not None and run.step >= stop_after):
            stopped_early = True
            break
        _train_step(run)
        step = run.step
        if run.eval_data is not None and tc.eval_every and step % tc.eval_every == 0 and step % tc.save_every:
            run.tau = _held_out_tau(run)  # a save estimates τ itself
        if tc.save_every and step % tc.save_every == 0:
            _save(run)
        bar.set_postfix(loss=f"{run.loss_ema:.3f}", tau="-" if run.tau is None else f"{run.tau:.2f}")
        bar.update(1)
        if step % tc.log_every == 0 or step == tc.steps:
            _log(run)
    return stopped_early


def _summary(run: Run, stopped_early: bool) -> dict:
    tc, cfg = run.tc, run.drafter.config
    return {"drafter": str(run.out_dir / "drafter"), "step": run.step, "steps": tc.steps,
            "first_loss": run.first_loss, "last_loss": run.last_loss, "tau_estimate": run.tau,
            "mask_token_id": tc.mask_token_id, "target_layer_ids": cfg.target_layer_ids,
            "dtype": str(run.target_dtype).removeprefix("torch."),
            "block_size": tc.block_size, "layers": tc.layers, "intermediate_size": cfg.intermediate_size,
            "train_seconds": run.seconds(), "stopped_early": stopped_early, "slots_seen": run.slots_seen,
            "n_sequences": len(run.data), "n_tokens": int(run.data.offsets[-1]), "world_size": run.world.size,
            "labelled_here": run.labelling}
