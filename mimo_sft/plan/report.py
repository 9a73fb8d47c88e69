"""How a plan is shown to people: a rich table on the terminal and a PNG of per-step rank loads.

Kept apart from the arithmetic so that ``--json`` (for scripts and tests) and the table read the
same dict, and matplotlib is imported only when a PNG is asked for (Agg: no display needed).
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from mimo_sft.console import make_console

UNITS = {"images": "patches", "language": "tokens", "gpus": "weighted load"}
CAPTION = ("max/mean: heaviest DP rank's load over the mean rank's, averaged over micro-batches (1.000 = "
           "balanced); p95 over micro-batches; max-min: heaviest minus lightest rank; idle: 1 - mean/max, the "
           "share of each micro-batch the average rank waits for the heaviest")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.1f}"


def print_plan(plan: dict, console: Console | None = None) -> None:
    console = console or make_console()
    r, d = plan["reorder"], plan["data"]
    steps, per = plan["steps"], plan["micro_batches_per_step"]
    lay = " · ".join(f"{n} dp={v['dp']} (ranks {v['ranks']})" for n, v in plan["layout"].items())
    console.print(f"[bold]mimo-sft plan[/bold] · {steps} micro-batches × {plan['micro_batch_size']} samples "
                  f"({steps // per} steps) · {d['dataloader_type']}, seed {d['seed']}")
    replaced = f", {d['replaced_too_long']} too long (replaced as training does)" if d["replaced_too_long"] else ""
    console.print(f"data    {d['dataset_path']}: {d['dataset_samples']} samples, {d['images']} images in the plan"
                  f"{replaced}")
    console.print(f"layout  {lay} · grid {plan['canonical_grid']}")
    weights = (f"encoder weight {r['encoder_cost_weight']:g} · language weight {r['language_cost_weight']:g} · "
               f"window {r['window_size']}")
    moved = r["bytes_per_micro_batch"]
    exchange = ("n/a (colocated: index only)" if moved["exchange"] is None else
                f"{moved['exchange'] / 1e6:.2f} MB")
    console.print(f"mode    --reorder-mode {r['mode']} · bytes between ranks per micro-batch: index 0, exchange "
                  f"{exchange}")
    if r.get("calibration"):
        console.print(f"weights {r['calibration']}")
    else:
        console.print("weights as configured: --reorder-calibrate-from RUN sets them from a run's measured encoder "
                      "and language phases")
    if r["enabled_in_config"]:
        console.print(f"reorder [green]ON[/green] in config · {weights}")
    else:
        console.print(f"reorder [yellow]OFF in config[/yellow] · {weights}")
        console.print("        the 'on' rows show what --intra-microbatch-reorder would do")
    table = Table(title="per-rank load per micro-batch, reordering off vs on", title_justify="left",
                  box=box.SIMPLE_HEAD, caption=CAPTION, caption_justify="left")
    for col in ("module", "reorder", "max/mean", "p95", "max-min", "p95", "idle"):
        table.add_column(col, justify="left" if col in ("module", "reorder") else "right", no_wrap=True)
    for name, m in plan["modules"].items():
        for when, label in (("before", "off"), ("after", "on")):
            unit = f"{UNITS[name]}, dp={m['dp']}" if name != "gpus" else f"vision + language / tp, {m['dp']} groups"
            first = f"[bold]{name}[/bold]" if when == "before" else unit
            table.add_row(first, label, f"{m[f'max_over_mean_{when}']:.3f}", f"{m[f'max_over_mean_p95_{when}']:.3f}",
                          _num(m[f"spread_{when}"]), _num(m[f"spread_p95_{when}"]), _pct(m[f"wait_share_{when}"]),
                          style="bold green" if when == "after" and name == _balanced_row(plan) else None)
        if name != list(plan["modules"])[-1]:
            table.add_section()
    console.print(table)
    img = plan["modules"]["images"]
    console.print(f"images: heaviest encoder rank {img['max_over_mean_before']:.2f}x -> {img['max_over_mean_after']:.2f}x "
                  f"the mean; idle {_pct(img['wait_share_before'])} -> {_pct(img['wait_share_after'])}")
    if "gpus" in plan["modules"]:
        g = plan["modules"]["gpus"]
        console.print(f"gpus (colocated: each GPU encodes its vision slice, then computes its share of its language "
                      f"DP rank): heaviest GPU {g['max_over_mean_before']:.2f}x -> {g['max_over_mean_after']:.2f}x "
                      f"the mean; idle {_pct(g['wait_share_before'])} -> {_pct(g['wait_share_after'])}")
    pos = plan["language_positions"]
    share = f" (each language cp rank 1/{pos['cp']} of its DP rank's)" if pos.get("cp", 1) > 1 else ""
    console.print(f"language: positions computed per rank per micro-batch{share}: padded {_num(pos['padded_per_rank'])} "
                  f"({_pct(pos['padding_fraction'])} padding) · packed {_num(pos['packed_per_rank'])} "
                  f"(--in-batch-packing is {'ON' if pos['in_batch_packing'] else 'off'} in config)")
    if plan["compare"]:
        _print_compare(plan, console)
    if plan.get("png"):
        console.print(f"plot: {plan['png']}")
    if plan.get("not_checked"):
        console.print(f"note: {plan['not_checked']}")


def _balanced_row(plan: dict) -> str:
    """The row reordering balances: the encoder ranks, or on colocated layouts every GPU."""
    return "gpus" if "gpus" in plan["modules"] else "images"


def _print_compare(plan: dict, console: Console) -> None:
    table = Table(title="what the window size and the language cost weight change", title_justify="left",
                  box=box.SIMPLE_HEAD)
    for col in ("setting", "images\nmax/mean", "images\nmax-min", "images\nidle", "language\nmax/mean", "language\nidle"):
        table.add_column(col, justify="left" if col == "setting" else "right", no_wrap=True)

    def add(label: str, img: dict, lang: dict, when: str, style=None) -> None:
        table.add_row(label, f"{img[f'max_over_mean_{when}']:.3f}", _num(img[f"spread_{when}"]),
                      _pct(img[f"wait_share_{when}"]), f"{lang[f'max_over_mean_{when}']:.3f}",
                      _pct(lang[f"wait_share_{when}"]), style=style)

    base = plan["modules"]
    add("reorder off", base["images"], base["language"], "before", "dim")
    add("as configured", base["images"], base["language"],
        "after", "bold")
    for row in plan["compare"]:
        label = (f"window {row['window_size']}" if row["varied"] == "window"
                 else f"language weight {row['language_cost_weight']:g}")
        add(label, row["images"], row["language"], "after")
    console.print(table)
    windows = [row for row in plan["compare"] if row["varied"] == "window"]
    if len({round(w["images"]["max_over_mean_after"], 12) for w in windows}) == 1 and len(windows) > 1:
        console.print("window size leaves the balance unchanged: each micro-batch is balanced on its own "
                      "(window_plan.window_routes); the window only sets how many micro-batches one exchange carries")


def write_png(plan: dict, path: str) -> str:
    """Heaviest and lightest rank per micro-batch, before (red) and after (blue), one panel per module."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(plan["modules"])
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 3.4 * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        m = plan["modules"][name]
        s = m["per_micro_batch"]
        x = list(range(1, len(s["mean"]) + 1))
        ax.fill_between(x, s["min_before"], s["max_before"], color="tab:red", alpha=0.12, step="mid")
        ax.fill_between(x, s["min_after"], s["max_after"], color="tab:blue", alpha=0.22, step="mid")
        ax.step(x, s["max_before"], where="mid", color="tab:red", lw=1.6,
                label=f"heaviest rank, reorder off (mean {m['max_over_mean_before']:.2f}x)")
        ax.step(x, s["min_before"], where="mid", color="tab:red", lw=1.0, ls="--", label="lightest rank, reorder off")
        ax.step(x, s["max_after"], where="mid", color="tab:blue", lw=1.8,
                label=f"heaviest rank, reorder on (mean {m['max_over_mean_after']:.2f}x)")
        ax.step(x, s["min_after"], where="mid", color="tab:blue", lw=1.0, ls="--", label="lightest rank, reorder on")
        ax.step(x, s["mean"], where="mid", color="black", lw=1.0, ls=":", label="mean rank")
        ax.set_ylabel(f"{UNITS[name]} per rank")
        ax.set_title(f"{name} (dp={m['dp']}): average rank idles {100 * m['wait_share_before']:.1f}% -> "
                     f"{100 * m['wait_share_after']:.1f}% of each micro-batch", loc="left", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    axes[-1, 0].set_xlabel("micro-batch (training order)")
    r = plan["reorder"]
    state = "on in config" if r["enabled_in_config"] else "OFF in config: 'on' = what it would do"
    fig.suptitle(f"mimo-sft plan: per-rank load, reordering {state} (encoder weight {r['encoder_cost_weight']:g}, "
                 f"language weight {r['language_cost_weight']:g})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
