"""click commands, one module per area; each is a thin wrapper over the library.

The parameter types below bound what a user can type before anything runs: a seed torch can
take, a thread count OpenMP can allocate for, floats that are numbers (click's FloatRange lets
NaN through, because every comparison with NaN is false)."""
from __future__ import annotations

import math

import click

MAX_THREADS = 1024   # OpenMP allocates per-thread state up front: 10^9 threads asks for ~200 GB
SEED = click.IntRange(0, 2**63 - 1)   # torch.Generator.manual_seed takes a 64-bit integer
THREADS = click.IntRange(1, MAX_THREADS)


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses NaN and +-inf."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return v


# --bundle of check / generate / bench: the pair a bundle serves, instead of --target / --drafter
BUNDLE_PAIR_OPTION = click.option(
    "--bundle", type=click.Path(file_okay=False, exists=True),
    help="Run a bundle's own target/ and drafter/ (quantized as its engines load them) instead of "
         "--target / --drafter.")


def pair_options(fn):
    """--target, --drafter and --bundle of generate and bench: the pair to run."""
    fn = BUNDLE_PAIR_OPTION(fn)
    fn = click.option("--drafter", type=click.Path(), help="DFlash drafter folder (default: the preset's drafter).")(fn)
    return click.option("--target", type=click.Path(),
                        help="Target folder or preset (default: embedded SmolLM2-135M).")(fn)
