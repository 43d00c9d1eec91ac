"""The process group of a training run: one process by default, N under torchrun.

    torchrun --nproc-per-node N [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT] \\
        -m dflash_trt.cli train-drafter ...      (or the `dflash-trt` script itself)

torchrun (torch.distributed.run) sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT;
without them (or with WORLD_SIZE=1) there is no process group and every collective below is the
identity. The backend is NCCL where the process has a GPU, gloo on CPU.

Data parallelism, DDP's scheme (replicated drafter and optimizer, gradients all-reduced before
each step) rather than FSDP2: the drafter is a few percent of the target (one to a few decoder
layers; a 1B-parameter drafter's fp32 weights and AdamW moments are 16 GB, replicated on any
current GPU), so sharding buys no memory that matters, and a replicated state is a plain
state dict that rank 0 writes and any world size reads back. The gradient all-reduce is one
flat collective per step, issued by the trainer rather than by DistributedDataParallel's
forward hooks: the loss calls two drafter entry points (project_context, forward), and a rank
whose share of a batch has no labelled slot still joins the collective with zeros.

A collective that fails (a peer rank died, the network went away) or outlasts `timeout` becomes
one DFlashError line naming this rank and what it was doing; torchrun then stops the others.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_trt.errors import DFlashError


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    failed: bool = False   # a collective failed and said so: the launcher's SIGTERM then ends it quietly

    @property
    def main(self) -> bool:
        """Rank 0: the one that logs, shows progress and writes checkpoints and the drafter."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    # ---- collectives: identities in one process
    def all_reduce(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Sum over ranks, in place (t on this rank's device)."""
        if self.distributed:
            self._run(lambda: dist.all_reduce(t, async_op=True), what)
        return t

    def all_gather(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        if not self.distributed:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._run(lambda: dist.all_gather(out, t, async_op=True), what)
        return out

    def barrier(self, what: str) -> None:
        if self.distributed:
            self._run(lambda: dist.barrier(async_op=True), what)

    def _run(self, start, what: str) -> None:
        """Start the collective, then wait for it in Python, not inside gloo/NCCL: a rank blocked in
        C++ never runs its SIGTERM handler, and torchrun's SIGTERM (a peer died) would end it
        without a word."""
        try:
            work = start()
            while not work.is_completed():
                time.sleep(0.0005)
            work.wait()
        except (RuntimeError, ValueError) as e:   # gloo/NCCL errors are RuntimeError subclasses (DistBackendError)
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            self.failed = True
            raise DFlashError(f"rank {self.rank}/{self.size}: {what} failed: a peer rank stopped or cannot be "
                              f"reached ({msg})") from None

    def check_replicas(self, tensors: list[torch.Tensor], what: str) -> None:
        """Every rank holds the same replica: (sum, sum of squares, sum of |x|·index) in float64 per
        rank, compared with rank 0's. Silent divergence (a rank with other data or other numerics)
        is an error here, at the checkpoint, not a wrong drafter later."""
        if not self.distributed:
            return
        s = torch.zeros(3, dtype=torch.float64)
        for t in tensors:
            x = t.detach().double().flatten().cpu()
            s += torch.stack([x.sum(), (x * x).sum(), (x.abs() * torch.arange(len(x), dtype=torch.float64)).sum()])
        sums = self.all_gather(s.to(self.device), f"{what} checksum")
        if bad := [r for r, v in enumerate(sums) if not torch.equal(v.cpu(), sums[0].cpu())]:
            raise DFlashError(f"rank {self.rank}/{self.size}: {what} differ between ranks (ranks {bad} vs rank 0: "
                              f"checksums {sums[bad[0]].tolist()} vs {sums[0].tolist()}); the replicas diverged")


def init_world(timeout_s: float = 1800.0) -> World:
    """The process group torchrun describes in the environment, or a one-process World."""
    env = os.environ
    size = int(env.get("WORLD_SIZE", "1") or 1)
    if size <= 1:
        return World()
    rank, local = int(env["RANK"]), int(env.get("LOCAL_RANK", "0"))
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", local) if gpu else torch.device("cpu")
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    if not dist.is_initialized():
        try:
            if gpu:
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if gpu else "gloo", timeout=timedelta(seconds=timeout_s),
                                    **({"device_id": device} if gpu else {}))
        except (RuntimeError, ValueError) as e:
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise DFlashError(f"rank {rank}/{size}: cannot join the process group at {where} ({msg}); check that "
                              "every node runs torchrun with the same --rdzv-endpoint and --nnodes") from None
    world = World(rank, size, local, device)
    _stop_cleanly_on_sigterm(world)
    return world


def _stop_cleanly_on_sigterm(world: World) -> None:
    """torchrun sends SIGTERM to the surviving ranks when one fails: say so in one line and exit,
    instead of a traceback from wherever the signal lands."""
    def stop(signum, frame):
        if world.failed:   # this rank has already said what went wrong
            os._exit(1)
        print(f"dflash-trt: rank {world.rank}/{world.size}: stopped by the launcher (signal {signum}): another rank "
              "failed; resume from the last checkpoint with --resume", file=sys.stderr, flush=True)
        os._exit(143)

    signal.signal(signal.SIGTERM, stop)
    # `kill -USR1 <pid>` prints every thread's Python stack: where a rank that seems stuck waits
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def close_world(world: World) -> None:
    """Leave the process group; after a failed collective there is none to leave cleanly (a
    teardown with a dead peer can block), the process just ends."""
    if world.distributed and dist.is_initialized() and not world.failed:
        dist.destroy_process_group()


def shard(n: int, world: World) -> range:
    """Indices of n items this rank takes (strided, so shares differ by at most one)."""
    return range(world.rank, n, world.size)
