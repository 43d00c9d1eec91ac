"""`dflash-trt plan --plot FILE.png`: tokens/s per GPU against tokens/s per user, AR and DFlash, one
line per layout (the speed model of plan/speed.py), with the published measurements of the same
target on the same node type marked. matplotlib's headless Agg backend; the PNG is written whole or
not at all (temp file and rename)."""
from __future__ import annotations

import io
import itertools
import math
import textwrap
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_write_bytes
from dflash_trt.plan.draft_schedule import CONTEXT_END
from dflash_trt.plan.speed import LayoutSpeed, SpeedReport, distinct_layouts
from dflash_trt.plan.speed_check import (
    METRIC_TEXT,
    describe_point,
    matching_points,
    point_figure,
    predict_point,
    verdict,
)

UNBOUNDED = (" (the model's AR never gives every user that many tokens/s, so any DFlash throughput there is an "
             "unbounded gain)")
MAX_LAYOUTS = 6      # lines beyond these crowd the plot; the text and JSON reports carry them all


def _matplotlib(path: str | Path):
    """matplotlib on its headless backend, `path` checked first (a *.png)."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise DFlashError(f"--plot {path}: the plot is written as PNG; name the file *.png")
    try:
        import matplotlib
    except ImportError:
        raise DFlashError("--plot needs matplotlib: pip install 'dflash-trt[plot]'") from None
    matplotlib.use("Agg", force=True)
    return matplotlib


def new_figure(path: str | Path):
    """(fig, ax, colors) of a PNG plot on these axes, `path` checked first (`bench --endpoint --plot`
    draws on the same axes)."""
    matplotlib = _matplotlib(path)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6.5), dpi=120)
    return fig, fig.add_subplot(), matplotlib.colormaps["tab10"].colors


def draw_layout(ax, layout: LayoutSpeed, tau: float | None, color, ar_label: str, dflash_label: str) -> None:
    """One layout's curves: AR dashed, DFlash solid (when there is a tau)."""
    ax.plot([p.ar_tokens_per_s_per_user for p in layout.points], [p.ar_tokens_per_s_per_gpu for p in layout.points],
            "--", color=color, marker=".", label=ar_label)
    if tau:
        ax.plot([p.dflash_tokens_per_s_per_user for p in layout.points],
                [p.dflash_tokens_per_s_per_gpu for p in layout.points], "-", color=color, marker="o", markersize=3,
                label=dflash_label)


def _label_axes(ax, title: str, ylabel: str = "tokens/s per GPU (decode, log scale)") -> None:
    """The shared axes: log tokens/s per GPU against tokens/s per user."""
    ax.set_yscale("log")
    ax.set_xlabel("tokens/s per user (decode)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)


def _write_png(fig, path: str | Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return atomic_write_bytes(Path(path), buf.getvalue())


def save_figure(fig, ax, path: str | Path, title: str, ylabel: str = "tokens/s per GPU (decode, log scale)") -> Path:
    """The shared axes, the title, the legend, the PNG written whole."""
    _label_axes(ax, title, ylabel)
    ax.legend(fontsize=7, loc="upper right")
    return _write_png(fig, path)


def plot_speed(report: SpeedReport, path: str | Path) -> Path:
    _matplotlib(path)
    return _write_png(speed_figure(report), path)


def speed_figure(report: SpeedReport):
    """The figure of `plan --plot`, every line, band and box labelled: the curves (top left), their legend (top
    right), the draft length K against concurrency (bottom left, its own axes so it covers no curve) and the
    published measurements of this target on this node with the model's verdict on each (bottom right)."""
    import matplotlib
    from matplotlib.figure import Figure

    layouts = distinct_curves(report)[:MAX_LAYOUTS]
    if not layouts:
        raise DFlashError(f"--plot: no layout of {report.target} on {report.hardware} has speed figures "
                          "(none fits inside one NVLink domain)")
    colors = matplotlib.colormaps["tab10"].colors
    fig = Figure(figsize=(13, 9.5), dpi=110)
    grid = fig.add_gridspec(2, 2, width_ratios=[2.3, 1], height_ratios=[2.4, 1], hspace=0.28, wspace=0.04)
    ax, key, kax, notes = (fig.add_subplot(grid[row, col]) for row, col in ((0, 0), (0, 1), (1, 0), (1, 1)))
    for i, (name, l) in enumerate(layouts):
        color = colors[i % len(colors)]
        draw_layout(ax, l, report.tau, color, f"{name} AR (dashed)", f"{name} DFlash, K {report.block_size - 1} "
                    "every step (solid)")
        end = l.points[-1]
        ar_end = (end.ar_tokens_per_s_per_user, end.ar_tokens_per_s_per_gpu)
        dflash_end = (end.dflash_tokens_per_s_per_user, end.dflash_tokens_per_s_per_gpu)
        for xy in (ar_end, dflash_end) if report.tau else (ar_end,):
            ax.annotate(f"{end.concurrency}", xy, fontsize=7, color=color, textcoords="offset points", xytext=(3, 3))
        if i == 0:
            _draw_ranges(ax, name, l, report.tau, color)
    if layouts[0][1].draft_schedule:
        draw_schedule(ax, kax, layouts[0][0], layouts[0][1], colors[0])
    else:
        kax.axis("off")
        kax.text(0, 0.5, "no draft schedule: plain decoding (no drafter or no tau)", fontsize=8)
    _draw_published(ax, notes, report)

    tau = f"DFlash tau {report.tau:g} (block {report.block_size})" if report.tau else "AR only"
    _label_axes(ax, f"{report.target} on {report.hardware}: {tau}, {report.context_tokens} tokens of context; speed "
                "model (dflash_trt/plan/cost.py, central efficiency)\nnumbers at line ends: concurrency (sequences "
                "per replica) at the layout's max_batch_size")
    key.axis("off")
    handles, labels = ax.get_legend_handles_labels()
    key.legend(handles, labels, loc="upper left", fontsize=7, frameon=False)
    return fig


def _draw_ranges(ax, name: str, layout: LayoutSpeed, tau: float | None, color) -> None:
    """The chosen layout's low and high efficiency sets: thin dotted lines, each labelled at its end."""
    modes = [("ar", "AR")] + ([("dflash", "DFlash")] if tau else [])
    for j, tag in ((0, "low"), (1, "high")):
        for mode, title in modes:
            xs = [getattr(p, f"{mode}_tokens_per_s_per_user_range")[j] for p in layout.points]
            ys = [getattr(p, f"{mode}_tokens_per_s_per_gpu_range")[j] for p in layout.points]
            first = (j, mode) == (0, "ar")
            ax.plot(xs, ys, ":", color=color, linewidth=0.9,
                    label=f"{name}: low / high efficiency sets (dotted)" if first else None)
            ax.annotate(f"{title} {tag}", (xs[0], ys[0]), fontsize=6, color=color, textcoords="offset points",
                        xytext=(2, -8))


def _draw_published(ax, notes, report: SpeedReport) -> None:
    """The published measurements of this target on this node: on the axes where they have a place (a star), a
    band for a claim over an interactivity range; each one written out with the model's figure and verdict."""
    lines = []
    for pt in matching_points(report.target, report.hardware):
        pr = predict_point(pt)
        fmt = point_figure(pt)
        text = "\n".join(textwrap.wrap(
            f"- {describe_point(pt)}. Model: {fmt(pr['central'])} (low set {fmt(pr['low'])}, high set "
            f"{fmt(pr['high'])}): {verdict(pt, pr)}" + (UNBOUNDED if math.isinf(pr["central"]) else ""), 70,
            subsequent_indent="  "))
        xy = _published_xy(pt)
        if xy:
            ax.plot(*xy, marker="*", markersize=13, color="black", linestyle="none",
                    label=f"published: {METRIC_TEXT.get(pt['metric'], pt['metric'])} (star)")
        elif "min_tokens_per_s_per_user" in pt:     # a claim over an interactivity band: shade it
            lo = pt["min_tokens_per_s_per_user"]
            hi = pt.get("max_tokens_per_s_per_user", lo * 1.2)
            ax.axvspan(lo, hi, color="grey", alpha=0.15,
                       label=f"published claim: users at {lo:g}-{hi:g} tok/s (grey band)")
            ax.text((lo + hi) / 2, 0.02, f"claim:\nDFlash >= {pt['value']:g}x\nAR per GPU\nwith users at\n"
                    f"{lo:g}-{hi:g} tok/s", transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=6)
        lines.append(text)
    notes.axis("off")
    body = "\n".join(lines) if lines else "none published for this target on this node (docs/speed-model.md)"
    notes.text(0, 1, f"Published measurements, {report.target} on {report.hardware}, against the model\n"
               "(the model's central figure, then its low and high efficiency sets; docs/speed-model.md):\n" + body,
               fontsize=7, va="top", wrap=True)


def draw_schedule(ax, kax, name: str, layout: LayoutSpeed, color) -> None:
    """The chosen layout's draft schedule: its curve on the main axes (the best K at each concurrency, beside
    always drafting the whole block and AR), and K against concurrency on its own axes (a line per context
    bucket for a schedule by context) with the concurrency from which speculation stops paying."""
    d, g = layout.draft_schedule, layout.gpus_per_replica
    lv = d["levels"]
    ax.plot([x["tokens_per_s_per_user"] for x in lv], [x["concurrency"] * x["tokens_per_s_per_user"] / g for x in lv],
            "-", color="black", linewidth=2.2, alpha=0.45,
            label=f"{name}: best K per concurrency (grey)")
    # a schedule by context: one line per context bucket (its entries' contexts), else the ranges at every context
    lines = {"": d["ranges"]} if not d.get("by_context") else {}
    for a, b, lo, hi, k in d.get("by_context", []):
        lines.setdefault(f" at context {lo}-{hi if hi < CONTEXT_END else 'on'}", []).append((a, b, k))
    for style, (where, ranges) in zip(itertools.cycle(("-", "--", ":", "-.")), lines.items()):
        kax.plot([c for a, b, _ in ranges for c in (a, b + 1)], [k for _, _, k in ranges for _ in (0, 1)], style,
                 color=color, linewidth=1.5, label=f"{name}: K drafted per step{where}")
    kax.set_xscale("log")
    kax.set_ylim(-0.5, d["max_k"] + 0.5)
    kax.set_xlabel("concurrency (sequences per replica)", fontsize=7)
    kax.set_ylabel("K: tokens drafted per step", fontsize=7)
    kax.tick_params(labelsize=7)
    kax.grid(True, which="both", alpha=0.3)
    stop = d["stop_concurrency"]
    if stop:
        kax.axvline(stop, color="grey", linestyle=":", linewidth=1, label=f"speculation stops paying ({stop})")
    kax.set_title(f"draft schedule of {name}: " + (f"no speculation from concurrency {stop}" if stop
                                                   else "speculation pays at every concurrency")
                  + f" (K {d['max_k']} = the whole block)", fontsize=8)
    kax.legend(fontsize=7, loc="lower left")


def distinct_curves(report: SpeedReport) -> list[tuple[str, LayoutSpeed]]:
    """The layouts with speed figures, those with the same figures merged under one name ("tp8 ep1/2/4/8":
    at tensor-parallel attention the expert-parallel split moves the same expected bytes per GPU)."""
    return [(f"tp{l.tp} ep{'/'.join(map(str, eps))}" + (" attn-DP" if l.attention_dp else ""), l)
            for eps, l in distinct_layouts(report.layouts)]


def _published_xy(pt: dict) -> tuple[float, float] | None:
    """Where a published point sits on these axes: a per-user figure at a known concurrency gives its
    per-GPU figure too (and the other way round); ratios and 'max' concurrencies have no place."""
    c, gpus = pt.get("concurrency"), pt["tp"]
    if not isinstance(c, int):
        return None
    if pt["metric"] == "ar_tokens_per_s_per_user":
        return pt["value"], c * pt["value"] / gpus
    if pt["metric"] == "ar_tokens_per_s_per_gpu":
        return pt["value"] * gpus / c, pt["value"]
    return None
