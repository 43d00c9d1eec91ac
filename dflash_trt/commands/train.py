"""train-drafter: train a DFlash drafter for a (small) target with the public recipe."""
from __future__ import annotations

import json
import os
from pathlib import Path

import click

from dflash_trt.commands import SEED, THREADS, FiniteFloatRange
from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import no_new_empty_dirs
from dflash_trt.models.config import MAX_CONTEXT, MAX_INTERMEDIATE

MAX_BLOCKS_PER_STEP = 4096  # one step holds blocks x block size drafter tokens of activations


def _check_against_target(tdir, mask_token_id: int | None, target_layers: list[int] | None,
                          max_new_tokens: int) -> None:
    """--mask-token-id, --target-layers and --max-new-tokens against the target's config, before any work."""
    from dflash_trt.io.checkpoint import load_config
    from dflash_trt.models.config import require_target_config

    path = Path(tdir) / "config.json"
    cfg = require_target_config(load_config(tdir), str(path))
    V, L = cfg["vocab_size"], cfg["num_hidden_layers"]
    ctx = cfg.get("max_position_embeddings") or MAX_CONTEXT
    if max_new_tokens >= ctx:
        raise DFlashError(f"--max-new-tokens {max_new_tokens}: must be below the target's context of {ctx} tokens "
                          f"(max_position_embeddings, {path})")
    if mask_token_id is not None and not 0 <= mask_token_id < V:
        raise DFlashError(f"--mask-token-id {mask_token_id}: outside the target vocabulary (0..{V - 1}, {path})")
    if target_layers is not None:
        if not target_layers or target_layers != sorted(set(target_layers)):
            raise DFlashError(f"--target-layers {target_layers}: expected distinct layer ids in ascending order")
        if not all(0 <= i < L for i in target_layers):
            raise DFlashError(f"--target-layers {target_layers}: layer ids must lie in 0..{L - 1} for this {L}-layer "
                              "target")


def _distill(ctx, param, value):
    if value is None:
        return 0
    kind, _, k = value.partition(":")
    if kind != "topk" or not k.isdigit() or not 1 <= int(k) <= 64:
        raise click.BadParameter(f"{value!r}: expected topk:K with K in 1..64, e.g. topk:8")
    return int(k)


def _layer_list(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated layer ids, e.g. 1,8,14,20,27") from None


@click.command("train-drafter")
@click.option("--target", type=click.Path(), help="Target folder or preset (default: embedded SmolLM2-135M).")
@click.option("--data", type=click.Path(dir_okay=False),
              help="Training data JSONL: rows with prompt_ids+output_ids (target responses) or prompt+response text.")
@click.option("--prompts", type=click.Path(dir_okay=False),
              help="Prompt JSONL ({\"prompt\": ...} lines): the target answers them first (resumable).")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True,
              help="Run folder: OUT/drafter (z-lab checkpoint), OUT/state (resume), OUT/log.jsonl.")
@click.option("--layers", type=click.IntRange(1, 16), help="Drafter decoder layers (default: 1, or --init-from's).")
@click.option("--intermediate-size", type=click.IntRange(16, MAX_INTERMEDIATE), help="Drafter MLP width (default: the target's, or --init-from's).")
@click.option("--target-layers", callback=_layer_list,
              help="Target layers whose outputs feed the drafter, e.g. 1,8,14,20,27 (default: 5 evenly spaced, or --init-from's).")
@click.option("--block-size", type=click.IntRange(2, 64), help="Draft block size (default: 16, or --init-from's).")
@click.option("--steps", type=click.IntRange(1), default=2000, show_default=True, help="Total optimizer steps.")
@click.option("--lr", type=FiniteFloatRange(0, 1, min_open=True), default=6e-4, show_default=True,
              help="Peak learning rate (warm-up, cosine to 10%).")
@click.option("--blocks-per-step", type=click.IntRange(1, MAX_BLOCKS_PER_STEP), default=32, show_default=True,
              help="Anchors per step.")
@click.option("--mask-token-id", type=click.IntRange(0), help="Token used for masked slots (default: an unused special token).")
@click.option("--save-every", type=click.IntRange(1), default=200, show_default=True, help="Checkpoint interval (steps).")
@click.option("--eval-every", type=click.IntRange(1), default=100, show_default=True, help="τ estimate interval.")
@click.option("--log-every", type=click.IntRange(1), default=10, show_default=True,
              help="OUT/log.jsonl line interval (steps).")
@click.option("--eval-prompts", type=click.Path(dir_okay=False),
              help="Held-out prompts (or data) JSONL for the τ estimate in the progress bar.")
@click.option("--max-new-tokens", type=click.IntRange(2, MAX_CONTEXT), default=192, show_default=True,
              help="Response length when the target answers --prompts.")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False),
              help="Start from this drafter (fine-tune): its weights, and its layers, block size, intermediate size, "
                   "target layers, mask token and draft vocabulary where no flag gives them.")
@click.option("--feature-cache", type=click.Path(file_okay=False),
              help="Where to cache target features (default OUT/features); share it between runs.")
@click.option("--resume", is_flag=True, help="Continue the run in OUT from its last checkpoint.")
@click.option("--auto-resume", is_flag=True,
              help="Resume when OUT holds a checkpoint, else start: for jobs whose pods restart (the training chart).")
@click.option("--time-limit", type=FiniteFloatRange(0, 10**7, min_open=True), help="Stop (and save) after this many minutes.")
@click.option("--threads", type=THREADS, default=2, show_default=True, help="torch CPU threads.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="The target's dtype for its answers and features (auto: bfloat16 where the CPU has it, "
                   "as the runtime; else float32).")
@click.option("--train-dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True,
              help="The drafter's matmuls in training: bf16 autocast (fast on CPUs with bf16 and on GPUs) or float32.")
@click.option("--labels", type=click.Choice(["data", "teacher-forced"]), default="data", show_default=True,
              help="data: each slot's label is the data's next token (the data must be the target's own greedy "
                   "answers). teacher-forced: the target's own prediction at each position, from one forward "
                   "pass per sequence, so any text is training data (`dflash-trt corpus`).")
@click.option("--distill", callback=_distill, metavar="topk:K",
              help="Add the KL divergence to the target's top-K next-token distribution beside the CE on its "
                   "argmax (e.g. topk:8).")
@click.option("--draft-vocab", type=click.Path(exists=True),
              help="A drafter folder or its draft_vocab.json: train logits over those tokens only (the ones the "
                   "runtime drafts from; a smaller lm_head), and ship the file with the drafter.")
@click.option("--anchors-per-seq", type=click.IntRange(1, 4096), default=8, show_default=True,
              help="At most this many anchors (blocks) from one sequence per step.")
@click.option("--gamma", type=FiniteFloatRange(0, 1000, min_open=True),
              help="Slot loss decay exp(-(k-1)/gamma) (default: 4 for B=8, 7 for B=16).")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--answer-engine", type=click.Choice(["auto", "vllm", "hf"]), default="auto", show_default=True,
              help="Who answers --prompts: vllm (batched generation in the vLLM environment $DFLASH_TRT_VLLM_ENV, "
                   "default .venv/vllm), hf (transformers' generate), auto (vllm where that environment exists).")
@click.option("--dist-timeout", type=FiniteFloatRange(0, 10**5, min_open=True), default=30, show_default=True,
              help="Under torchrun: minutes a rank waits in a collective (e.g. while rank 0 answers the prompts) "
                   "before it gives up.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary at the end.")
def train_drafter_cmd(target, data, prompts, out, layers, intermediate_size, target_layers, block_size, steps, lr,
                      blocks_per_step, mask_token_id, save_every, eval_every, log_every, eval_prompts, max_new_tokens,
                      init_from, feature_cache, resume, auto_resume, time_limit, threads, dtype, labels, distill, draft_vocab,
                      anchors_per_seq, gamma, seed, train_dtype, answer_engine, dist_timeout, as_json):
    """Train a DFlash block-diffusion drafter for a target (the recipe in docs/decode-loop.md): the target
    answers prompts, its hidden states at the chosen layers are cached once, then random anchors,
    masked blocks with per-anchor attention and a position-decayed cross-entropy; the target's
    embeddings and lm_head stay frozen. Checkpoints every --save-every steps; --resume continues.

    \b
    Examples:
      dflash-trt train-drafter --prompts my_prompts.jsonl --out runs/d1 --steps 3000 \\
          --eval-prompts heldout.jsonl                       # embedded SmolLM2-135M target
      dflash-trt corpus --out corpus.jsonl --max-rows 4000   # stdlib code as chat rows
      dflash-trt train-drafter --data corpus.jsonl --labels teacher-forced --distill topk:8 \\
          --out runs/tf --eval-prompts heldout.jsonl        # labelled by the target in one pass each
      dflash-trt train-drafter --target tiny/target --prompts p.jsonl --out runs/t --steps 50
      dflash-trt train-drafter --out runs/d1 --prompts my_prompts.jsonl --steps 6000 --resume
      torchrun --nproc-per-node 8 -m dflash_trt.cli train-drafter --target DIR --data d.jsonl --out /shared/run
      torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29400 --rdzv-id run1 \\
          -m dflash_trt.cli train-drafter ... --out /shared/run   # OUT on storage every node sees
    The drafter is OUT/drafter: `dflash-trt generate --drafter OUT/drafter ...`.
    Under torchrun (gloo on CPU, NCCL on GPU) --blocks-per-step and --lr mean what they mean in one
    process (the global batch is split over the ranks); only rank 0 logs and writes; a run's
    checkpoint resumes at any world size.
    """
    from dflash_trt.presets.catalog import resolve_target
    from dflash_trt.train.distributed import close_world, init_world
    from dflash_trt.train.initial import TrainConfig, settle
    from dflash_trt.train.trainer import train_drafter

    if (data is None) == (prompts is None):
        raise DFlashError("give exactly one of --data FILE.jsonl or --prompts FILE.jsonl")
    tdir = resolve_target(target)
    resume = resume or (auto_resume and (Path(out) / "state" / "state.json").is_file())
    _check_against_target(tdir, mask_token_id, target_layers, max_new_tokens)
    if Path(os.path.realpath(out)).is_relative_to(os.path.realpath(tdir)):  # (a run folder is not replaced:
        # only writing into the model folder is refused)
        raise DFlashError(f"--out {out}: lies inside --target {tdir}; write the run outside the target folder")
    tc = TrainConfig(layers=layers, block_size=block_size, intermediate_size=intermediate_size,
                     target_layer_ids=target_layers, mask_token_id=mask_token_id, steps=steps, lr=lr,
                     blocks_per_step=blocks_per_step, save_every=save_every, eval_every=eval_every,
                     log_every=log_every, train_dtype=train_dtype, seed=seed,
                     init_from=init_from, labels=labels, distill_k=distill, anchors_per_seq=anchors_per_seq,
                     gamma=gamma, draft_vocab=str(Path(draft_vocab).resolve()) if draft_vocab else None)
    world = init_world(timeout_s=dist_timeout * 60)
    taken = None if resume else settle(tc)   # a resumed run keeps its own settings (its state)
    if taken and world.main:
        click.echo(taken, err=True)
    try:
        with no_new_empty_dirs(out, feature_cache):   # a failed run leaves no empty --out behind
            summary = train_drafter(tdir, data or prompts, out, tc, eval_path=eval_prompts, resume=resume,
                                    max_new_tokens=max_new_tokens, threads=threads,
                                    time_limit_s=time_limit * 60 if time_limit else None,
                                    feature_cache=feature_cache, dtype=dtype, world=world,
                                    answer_engine=answer_engine)
    finally:
        close_world(world)
    if world.main:   # only rank 0 reports
        _report_training(summary, as_json)


def _report_training(summary: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    tau = summary["tau_estimate"]
    click.echo(f"step {summary['step']}/{summary['steps']}: loss {summary['first_loss']:.3f} -> "
               f"{summary['last_loss']:.3f}" + (f", held-out tau ~{tau:.2f}" if tau is not None else "")
               + f"; drafter in {summary['drafter']}")


@click.command("corpus")
@click.option("--out", "out", type=click.Path(dir_okay=False), required=True, help="JSONL file to write.")
@click.option("--max-rows", type=click.IntRange(1), help="Keep this many rows (a deterministic shuffle first).")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Shuffle and request wording.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def corpus_cmd(out, max_rows, seed, as_json):
    """Write an in-domain training corpus for `train-drafter --labels teacher-forced`: every function
    of this Python's standard library as a chat row ({"prompt": a "write this function" request,
    "response": its real source}), plus docstring "explain" rows. The held-out modules of
    train/prompts.py and the whole test suite are left out. The target labels the rows itself.
    Measured on the embedded SmolLM2-135M: the corpus alone LOWERED held-out tau (1.745 -> 1.685;
    its answers loop, stdlib code does not); its own answers, teacher-forced, raised it (MODEL_CARD.md).

    \b
    Example:
      dflash-trt corpus --out corpus.jsonl --max-rows 4000
      dflash-trt train-drafter --data corpus.jsonl --labels teacher-forced --out runs/tf
    """
    from dflash_trt.io.atomic import atomic_write_text
    from dflash_trt.train.corpus import build_corpus

    rows, about = build_corpus(max_rows, seed)
    atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
    if as_json:
        click.echo(json.dumps({"file": out, **about}, indent=2))
    else:
        click.echo(f"wrote {out}: {about['rows']} rows from {about['files']} files of the {about['source']}")


@click.command("deploy-train")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True,
              help="Folder to write: values.yaml and manifests/*.yaml (Helm's rendering of the training chart).")
@click.option("--nodes", type=click.IntRange(1, 1024), default=2, show_default=True, help="Pods (torchrun --nnodes).")
@click.option("--gpus-per-node", type=click.IntRange(0, 16), default=8, show_default=True,
              help="GPUs per pod, one rank each (0: CPU ranks, --cpu-ranks per pod).")
@click.option("--cpu-ranks", type=click.IntRange(1, 256), default=1, show_default=True)
@click.option("--gpu-product", default="", help="nvidia.com/gpu.product node label, e.g. NVIDIA-H200.")
@click.option("--image", help="Training image REPOSITORY:TAG or REPOSITORY@sha256:DIGEST (dflash-trt with CUDA torch).")
@click.option("--existing-claim", default="", help="A ReadWriteMany PVC holding target, data, features and runs.")
@click.option("--size", default="1Ti", show_default=True, help="Size of the PVC the chart creates.")
@click.option("--storage-class", default="", help="storageClassName of the PVC the chart creates.")
@click.option("--target", "target", default="/data/target", show_default=True, help="Target folder on the volume.")
@click.option("--data", default="/data/data.jsonl", show_default=True, help="--data on the volume.")
@click.option("--run-dir", default="/data/run", show_default=True, help="train-drafter --out on the volume.")
@click.option("--train-arg", "train_args", multiple=True, help="A further train-drafter argument (repeat), e.g. --steps.")
@click.option("--adapt-bundle", default="", metavar="PATH",
              help="Run `dflash-trt adapt` on this bundle (on the volume) instead of train-drafter; --run-dir is its "
                   "run folder, --train-arg its further options.")
@click.option("--traffic", default="/data/traffic", show_default=True, help="--adapt-bundle: the request log.")
@click.option("--revision-out", default="", metavar="PATH", help="--adapt-bundle: the revision to write (default: "
              "BUNDLE-adapted).")
@click.option("--release", default="dflash-trt", show_default=True)
@click.option("--namespace", default="default", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def deploy_train_cmd(out, nodes, gpus_per_node, cpu_ranks, gpu_product, image, existing_claim, size, storage_class,
                     target, data, run_dir, train_args, adapt_bundle, traffic, revision_out, release, namespace, as_json):
    """Render the training chart (deploy/helm/dflash-trt-train): an Indexed Job of --nodes pods
    running train-drafter under torchrun (c10d rendezvous at pod 0, a headless Service), GPUs per pod,
    one shared volume; a restarted pod resumes from the run's last checkpoint. Helm's own engine
    renders it and refuses what cannot run. Apply with `kubectl apply -f OUT/manifests` or install
    the chart with OUT/values.yaml.

    \b
    Example:
      dflash-trt deploy-train --out deploy/train --nodes 4 --gpus-per-node 8 --gpu-product NVIDIA-H200 \\
          --image registry.example.com/dflash-trt-train:0.1.0 --existing-claim drafter-data \\
          --train-arg=--steps --train-arg=20000
      dflash-trt deploy-train --out deploy/adapt --nodes 1 --gpus-per-node 8 --adapt-bundle /data/bundle \\
          --traffic /data/logs --revision-out /data/bundle-r2 --run-dir /data/adapt-run   # `adapt` as the Job
    """
    from dflash_trt.deploy.values import parse_image, render, write_deployment
    from dflash_trt.paths import deploy_path

    values = {"nodes": nodes, "gpu": {"count": gpus_per_node, "product": gpu_product}, "cpuRanksPerPod": cpu_ranks,
              "storage": {"existingClaim": existing_claim, "size": size, "storageClassName": storage_class},
              "train": {"target": target, "data": data, "out": run_dir, "extraArgs": list(train_args)}}
    if adapt_bundle:   # the same Job, rendezvous and volume; only the command differs (docs/adapt.md)
        values["adapt"] = {"bundle": adapt_bundle, "traffic": traffic,
                           "out": revision_out or adapt_bundle.rstrip("/") + "-adapted"}
    if image:
        values["image"] = parse_image(image, "--image")
    chart = deploy_path("helm", "dflash-trt-train")
    manifests = render(values, chart=chart, release=release, namespace=namespace)
    folder = write_deployment(out, values, manifests, header="# dflash-trt deploy-train: values of the dflash-trt-train chart\n")
    files = sorted(p.name for p in (folder / "manifests").iterdir())
    if as_json:
        click.echo(json.dumps({"out": str(folder), "values": values, "manifests": files}, indent=2))
    else:
        click.echo(f"wrote {folder}: values.yaml, manifests/ ({', '.join(files)})")
