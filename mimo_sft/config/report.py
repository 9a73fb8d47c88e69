"""Human output of ``validate``: the layout table, notes, problems and a verdict (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from mimo_sft.config.checks.registry import CheckResult
from mimo_sft.config.schema import ExperimentConfig


def print_report(cfg: ExperimentConfig, result: CheckResult, console: Console, *, show_config: bool = True,
                 config_text: str | None = None) -> None:
    layout = result.layout
    if show_config and config_text:
        console.print("[bold]Resolved config[/bold]")
        console.print(config_text.rstrip(), highlight=False, markup=False)
        console.print()
    if layout is not None and layout.components:
        mbs = cfg.train.micro_batch_size
        mode = "colocated" if layout.colocated else "non-colocated"
        ranks = f"{layout.world_size} rank{'s' if layout.world_size != 1 else ''}"
        title = (f"Layout: {ranks}, {mode}, canonical grid {layout.canonical_grid}, "
                 f"micro-batch {mbs}, global batch {cfg.train.global_batch_size}")
        table = Table(title=title, title_justify="left")
        experts = any(s.ep > 1 or s.etp is not None for s in layout.components)  # ep/etp columns only where set
        cols = ("module", "ranks", "tp", "pp", "cp", "dp") + (("ep", "etp") if experts else ()) + (
            "canonical groups per DP rank", "samples per rank")
        for col in cols:
            table.add_column(col, justify="left" if col in ("module", "ranks", "canonical groups per DP rank") else "right")
        specs = {s.name: s for s in layout.components}
        for row in layout.rank_rows(mbs):
            groups = row["canonical_groups"]
            shown = ", ".join(groups[:8]) + (f", ... ({len(groups)} ranks)" if len(groups) > 8 else "")
            s = specs[row["module"]]
            ep = (str(s.ep), str(s.expert_tp)) if experts else ()
            table.add_row(row["module"], row["ranks"], str(row["tp"]), str(row["pp"]), str(row["cp"]), str(row["dp"]),
                          *ep, shown, "-" if row["samples_per_rank"] is None else str(row["samples_per_rank"]))
        console.print(table)
        r = cfg.reorder
        data_mode = "scalable DP (each rank reads its shard)" if cfg.parallel.scalable_dp else "every rank reads the whole micro-batch"
        how = ("by index, no bytes between ranks" if r.mode == "index" else
               f"exchange, window {r.window_size}, {'overlapped' if r.overlap else 'synchronous'}")
        reorder = (f"on ({how}, cost weights encoder {r.encoder_cost_weight} / language "
                   f"{r.language_cost_weight}{', calibrated' if r.calibration else ''})") if r.enabled else "off"
        packing = "packed (one padding-free sequence per language rank)" if cfg.data.in_batch_packing else "padded rows"
        cp = layout.spec("language").cp if layout is not None and "language" in layout.names else 1
        if cp > 1:  # model.context_parallel
            packing += (f", context parallel {cp} (each document padded to a multiple of {2 * cp} and split over the cp "
                        f"ranks, zigzag)")
        kernel = {"auto": "auto attention (varlen on a CUDA GPU in bf16, else sdpa)"}.get(
            cfg.model.attention_backend, f"{cfg.model.attention_backend} attention")
        console.print(f"data: {data_mode}; reordering: {reorder}; language: {packing}, {kernel}")
        if r.calibration:
            console.print(f"cost weights {r.calibration}")
        if r.encoder_balance:
            console.print("encoder-only balancing: each image encoded on the least-loaded tower of its vision DP "
                          "group, its embeddings and their gradients sent back (--encoder-balance)")
    if result.memory is not None:
        print_memory(result.memory, console)
    for note in result.notes:
        console.print(f"[yellow]note[/yellow] {note}", highlight=False, soft_wrap=True)
    if result.ok:
        console.print("[bold green]VALID[/bold green]: this layout and config pass every check.")
    else:
        console.print(f"[bold red]INVALID[/bold red]: {len(result.problems)} problem(s):")
        for p in result.problems:
            console.print(f"  x {p}", highlight=False, markup=False, soft_wrap=True)


#: the forecast table's columns, in order (a module without a term shows "-")
MEMORY_COLUMNS = ("weights", "gradients", "optimizer", "activations", "recompute", "logits", "inputs", "bridge",
                  "allowance")


def print_memory(memory: dict, console: Console) -> None:
    """The memory forecast (check 23, ``MemoryForecast.report``) as a table: GiB per term on each
    module's most loaded rank, then each GPU group's verdict."""
    gib = 1024 ** 3
    budget = memory["budget_bytes"]
    table = Table(title=f"Memory forecast per GPU (GiB), budget {budget / gib:.1f} GiB: {memory['budget_source']}",
                  title_justify="left")
    for col in ("module", "rank", "params") + MEMORY_COLUMNS + ("peak",):
        table.add_column(col, justify="left" if col in ("module", "rank") else "right")
    for name, m in memory["modules"].items():
        cells = [f"{m['terms'][c] / gib:.1f}" if c in m["terms"] else "-" for c in MEMORY_COLUMNS]
        table.add_row(name, m["rank"], f"{m['parameters'] / 1e9:.2f}B", *cells, f"{m['peak_bytes'] / gib:.1f}")
    console.print(table)
    verdicts = ", ".join(f"{g} {p / gib:.1f} GiB {'fits' if p <= budget else 'DOES NOT FIT'}"
                         for g, p in memory["gpu_peaks"].items())
    console.print(f"memory: {verdicts} ({memory['workload']}; docs/memory.md)", highlight=False)
    worst = memory.get("worst_case")
    if worst:  # the data's figure is in force; the worst case beside it
        peaks = ", ".join(f"{g} {p / gib:.1f} GiB" for g, p in worst["gpu_peaks"].items())
        console.print(f"memory, not in force: {peaks} for the {worst['workload']}", highlight=False)
