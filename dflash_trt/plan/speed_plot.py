"""`dflash-trt plan --plot FILE.png`: tokens/s per GPU against tokens/s per user, AR and DFlash, one
line per layout (the speed model of plan/speed.py), with the published measurements of the same
target on the same node type marked. matplotlib's headless Agg backend; the PNG is written whole or
not at all (temp file and rename)."""
from __future__ import annotations

import io
from pathlib import Path

from dflash_trt.plan.speed import LayoutSpeed, SpeedReport, matching_points
from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_write_bytes

MAX_LAYOUTS = 6      # lines beyond these crowd the plot; the text and JSON reports carry them all


def new_figure(path: str | Path):
    """(fig, ax, colors) of a PNG plot on these axes, `path` checked first (`bench --endpoint --plot`
    draws on the same axes)."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise DFlashError(f"--plot {path}: the plot is written as PNG; name the file *.png")
    try:
        import matplotlib
    except ImportError:
        raise DFlashError("--plot needs matplotlib: pip install 'dflash-trt[plot]'") from None
    matplotlib.use("Agg", force=True)
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


def save_figure(fig, ax, path: str | Path, title: str, ylabel: str = "tokens/s per GPU (decode, log scale)") -> Path:
    """The shared axes (log tokens/s per GPU against tokens/s per user), the title, the PNG written whole."""
    ax.set_yscale("log")
    ax.set_xlabel("tokens/s per user (decode)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return atomic_write_bytes(Path(path), buf.getvalue())


def plot_speed(report: SpeedReport, path: str | Path) -> Path:
    fig, ax, colors = new_figure(path)
    layouts = distinct_curves(report)[:MAX_LAYOUTS]
    if not layouts:
        raise DFlashError(f"--plot: no layout of {report.target} on {report.hardware} has speed figures "
                          "(none fits inside one NVLink domain)")
    for i, (name, l) in enumerate(layouts):
        color = colors[i % len(colors)]
        draw_layout(ax, l, report.tau, color, f"{name} AR", f"{name} DFlash")
        if i == 0:   # the chosen layout: the low and high efficiency sets as thin lines
            for j, tag in ((0, "low"), (1, "high")):
                ax.plot([p.ar_tokens_per_s_per_user_range[j] for p in l.points],
                        [p.ar_tokens_per_s_per_gpu_range[j] for p in l.points], ":", color=color, linewidth=0.8,
                        label=f"{name}: low and high efficiency" if j == 0 else None)
                if report.tau:
                    ax.plot([p.dflash_tokens_per_s_per_user_range[j] for p in l.points],
                            [p.dflash_tokens_per_s_per_gpu_range[j] for p in l.points], ":", color=color,
                            linewidth=0.8)
        ax.annotate(f"{l.points[-1].concurrency}", (l.points[-1].ar_tokens_per_s_per_user,
                                                    l.points[-1].ar_tokens_per_s_per_gpu),
                    fontsize=7, color=color, textcoords="offset points", xytext=(3, 3))

    if layouts and layouts[0][1].draft_schedule:
        draw_schedule(ax, layouts[0][0], layouts[0][1], colors[0])
    claims, marked = [], 0
    for pt in matching_points(report.target, report.hardware):
        xy = _published_xy(pt)
        if xy:
            ax.plot(*xy, marker="*", markersize=13, color="black", linestyle="none")
            ax.annotate(f"{pt['id']}\n{pt['metric']} {pt['compare']} {pt['value']:,}", xy, fontsize=7,
                        textcoords="offset points", xytext=(8, 4 - 24 * marked))   # stacked, not overlapping
            marked += 1
        else:
            claims.append(f"{pt['id']}: {pt['metric']} {pt['compare']} {pt['value']:,}")
            if "min_tokens_per_s_per_user" in pt:     # a claim over an interactivity band: shade it
                lo = pt["min_tokens_per_s_per_user"]
                ax.axvspan(lo, pt.get("max_tokens_per_s_per_user", lo * 1.2), color="grey", alpha=0.15)
    if claims:
        ax.text(0.01, 0.01, "published (not a point on these axes):\n" + "\n".join(claims), fontsize=7,
                transform=ax.transAxes, va="bottom", bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "grey"})

    tau = f"DFlash tau {report.tau:g} (block {report.block_size})" if report.tau else "AR only"
    return save_figure(fig, ax, path, f"{report.target} on {report.hardware}: {tau}, {report.context_tokens} tokens "
                       "of context\nspeed model, dflash_trt/plan/speed.py (central efficiency; dotted: low / high); "
                       "numbers at line ends: concurrency")


def draw_schedule(ax, name: str, layout: LayoutSpeed, color) -> None:
    """The chosen layout's draft schedule: its curve (the best K at each concurrency) beside always-K (the
    DFlash line) and AR, and an inset of K against concurrency with the concurrency where speculation stops."""
    d, g = layout.draft_schedule, layout.gpus_per_replica
    lv = d["levels"]
    ax.plot([x["tokens_per_s_per_user"] for x in lv], [x["concurrency"] * x["tokens_per_s_per_user"] / g for x in lv],
            "-", color="black", linewidth=2.2, alpha=0.55, label=f"{name} draft schedule (best K per concurrency)")
    ins = ax.inset_axes([0.07, 0.08, 0.3, 0.26])
    xs = [c for a, b, _ in d["ranges"] for c in (a, b + 1)]
    ys = [k for _, _, k in d["ranges"] for _ in (0, 1)]
    ins.plot(xs, ys, "-", color=color, linewidth=1.5)
    ins.set_xscale("log")
    ins.set_ylim(-0.5, d["max_k"] + 0.5)
    ins.set_xlabel("concurrency", fontsize=6)
    ins.set_ylabel("K drafted", fontsize=6)
    ins.tick_params(labelsize=6)
    stop = d["stop_concurrency"]
    ins.set_title(f"{name}: " + (f"no speculation from {stop}" if stop else "speculation pays throughout"),
                  fontsize=6)
    if stop:
        ins.axvline(stop, color="grey", linestyle=":", linewidth=1)


def distinct_curves(report: SpeedReport) -> list[tuple[str, LayoutSpeed]]:
    """The layouts with speed figures, those with the same curve merged under one name ("tp8 ep1/2/4/8":
    at tensor-parallel attention the expert-parallel split moves the same expected bytes per GPU)."""
    out: dict[tuple, tuple[list[int], LayoutSpeed]] = {}
    for l in report.layouts:
        if not l.points:
            continue
        key = (l.tp, l.attention_dp, tuple(round(p.ar_tokens_per_s_per_gpu, 6) for p in l.points))
        out.setdefault(key, ([], l))[0].append(l.ep)
    return [(f"tp{l.tp} ep{'/'.join(map(str, eps))}" + (" attn-DP" if l.attention_dp else ""), l)
            for eps, l in out.values()]


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
