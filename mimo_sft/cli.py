"""The ``mimo-sft`` command line: thin parsing, a call into the package, an exit code.

``finetune``, ``validate``, ``evaluate`` and ``plan`` share one flag table generated from the config schema
(``config.loader.flag_table``), so a flag means the same thing everywhere. User mistakes arrive as
``UserError`` and are printed as one line with exit status 2; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from mimo_sft.config.schema import CheckpointConfig
from mimo_sft.console import make_console
from mimo_sft.errors import UserError
from mimo_sft.generate import Decoding

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fine-tune Qwen-VL models on megatron-core's MIMO model.")
FLAG_COMMAND = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _fail(err: UserError, console: Console | None = None) -> None:
    msg = str(err)
    print(f"error: {msg}", file=sys.stderr)
    raise typer.Exit(err.exit_code)


def _print_flag_help(command: str, extra: dict[str, str] | None = None) -> None:
    from mimo_sft.config.loader import EXTRA_FLAGS, flag_table

    console = make_console(pipe_width=160)  # off a terminal the meanings wrap at 160 columns
    console.print(f"Usage: mimo-sft {command} [--config FILE] [--component NAME=k=v,...]... [FLAGS]\n")
    table = Table(show_header=True, header_style="bold", box=None)
    table.add_column("flag", no_wrap=True)
    table.add_column("config key", no_wrap=True)
    table.add_column("meaning")
    for flag, text in {**EXTRA_FLAGS, **(extra or {})}.items():
        table.add_row(flag, "", text)
    for flag, spec in flag_table().items():
        shown = flag + (f" / --no-{flag[2:]}" if spec.negatable and spec.type is bool else "")
        if spec.type is not bool:
            shown += " " + ("{" + ",".join(spec.choices) + "}" if spec.choices else spec.type.__name__.upper())
        table.add_row(shown, f"{spec.section}.{spec.name}", spec.help)
    console.print(table)


def _wants_help(args: list[str]) -> bool:
    return "--help" in args or "-h" in args


@app.command(context_settings=FLAG_COMMAND)
def validate(ctx: typer.Context) -> None:
    """Dry run: load the config exactly as finetune does, run every check, print layout and verdict."""
    from mimo_sft.validate import check_config
    from mimo_sft.config.loader import dump_config, load_config
    from mimo_sft.config.report import print_report

    args = list(ctx.args)
    if _wants_help(args):
        _print_flag_help("validate", {"--json": "print the verdict and problems as one JSON object",
                                      "--quiet": "do not print the resolved config"})
        return
    as_json = "--json" in args
    quiet = "--quiet" in args
    args = [a for a in args if a not in ("--json", "--quiet")]
    try:
        cfg = load_config(args)
    except UserError as e:
        if as_json:
            print(json.dumps({"ok": False, "problems": e.problems}))
            raise typer.Exit(2)
        for p in e.problems[1:]:
            print(f"error: {p}", file=sys.stderr)
        _fail(e)
    result = check_config(cfg)
    if as_json:
        layout = result.layout
        print(json.dumps({
            "ok": result.ok,
            "problems": [str(p) for p in result.problems],
            "notes": [str(p) for p in result.notes],
            "world_size": layout.world_size if layout else None,
            "canonical_grid": layout.canonical_grid if layout else None,
            "colocated": layout.colocated if layout else None,
            "modules": layout.rank_rows(cfg.train.micro_batch_size) if layout else [],
            **_memory_json(result.memory),
        }))
    else:
        print_report(cfg, result, make_console(), show_config=not quiet, config_text=dump_config(cfg))
    if not result.ok:
        raise typer.Exit(2)


def _memory_json(memory: dict | None) -> dict:
    """``validate --json``'s memory keys: each module's forecast and the budget it was held to."""
    if memory is None:
        return {"memory": None}
    return {"memory": memory["modules"], "gpu_memory_bytes": memory["budget_bytes"], "memory_workload": memory["workload"],
            "memory_worst_case": memory.get("worst_case")}


@app.command(context_settings=FLAG_COMMAND)
def finetune(ctx: typer.Context) -> None:
    """Fine-tune: mimo-sft finetune --nproc-per-node N [flags] (or torchrun --nproc-per-node N -m mimo_sft finetune)."""
    from mimo_sft.train import run
    from mimo_sft.train.elastic import LAUNCH_HELP

    _run_flag_command("finetune", ctx, lambda args: run.finetune(args), LAUNCH_HELP)


def _run_flag_command(name: str, ctx: typer.Context, fn, extra_help: dict[str, str] | None = None) -> None:
    """Shared body of the commands that take the config flag table: help, call, exit code."""
    args = list(ctx.args)
    if _wants_help(args):
        _print_flag_help(name, extra_help)
        return
    try:
        code = fn(args)
    except UserError as e:
        _fail(e)
    raise typer.Exit(code or 0)


@app.command(context_settings=FLAG_COMMAND)
def evaluate(ctx: typer.Context) -> None:
    """Validation loss of a checkpoint (or --hf-model alone) on a dataset, on any layout:
    mimo-sft evaluate --nproc-per-node N [CHECKPOINT] [flags] [--json] (or under torchrun)."""
    from mimo_sft.train.elastic import LAUNCH_HELP
    from mimo_sft.train.evaluate import EVALUATE_FLAGS, evaluate_command

    _run_flag_command("evaluate", ctx, evaluate_command, {**EVALUATE_FLAGS, **LAUNCH_HELP})


@app.command("check-model")
def check_model(
    hf_model: str = typer.Option(..., "--hf-model", help="Hugging Face Qwen-VL folder to verify"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    tolerance: float = typer.Option(1e-5, "--tolerance", help="largest acceptable relative logit difference"),
) -> None:
    """Run the checkpoint through transformers and through mimo-sft's megatron model; compare logits."""
    if not os.path.isdir(hf_model):
        _fail(UserError(f"--hf-model {hf_model}: folder not found; point it at a Hugging Face Qwen-VL checkpoint folder"))
    from mimo_sft.quiet import quiet_libraries

    quiet_libraries()
    from mimo_sft.model.check import check_model as run_check

    try:
        report = run_check(hf_model, tolerance=tolerance)
    except UserError as e:
        _fail(e)
    if as_json:
        print(json.dumps(report))
    else:
        console = make_console()
        verdict = "[bold green]OK[/bold green]" if report["ok"] else "[bold red]MISMATCH[/bold red]"
        console.print(f"{verdict} {hf_model}: max relative logit difference {report['max_rel_logit_diff']:.3e}, "
                      f"loss difference {report['loss_diff']:.3e} (tolerance {tolerance:g})")
        if "gdn_kernels" in report:
            console.print(report["gdn_kernels"], highlight=False, markup=False)
    if not report["ok"]:
        raise typer.Exit(1)


#: ``--export-shard-size`` as the schema declares it (finetune --export-hf takes the same flag)
_SHARD_SIZE = next(f for f in dataclasses.fields(CheckpointConfig) if f.name == "export_shard_size")


@app.command()
def export(
    checkpoint: str = typer.Option(..., "--checkpoint", help="a mimo-sft checkpoint folder (or its parent with 'latest')"),
    out: str = typer.Option(..., "--out", help="folder to write the Hugging Face checkpoint into"),
    hf_model: Optional[str] = typer.Option(None, "--hf-model", help="source HF folder (default: the one recorded in the checkpoint)"),
    adapter_only: bool = typer.Option(False, "--adapter-only", help="LoRA checkpoint: write a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) instead of merged weights"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32 or bf16: the dtype of the written weights (default: the run's training --dtype)"),
    shard_size: str = typer.Option(_SHARD_SIZE.default, "--export-shard-size", help=_SHARD_SIZE.metadata["help"]),
) -> None:
    """Write a fine-tuned checkpoint as a Hugging Face folder that transformers loads (LoRA: merged, or a PEFT adapter)."""
    from mimo_sft.quiet import quiet_libraries

    quiet_libraries()
    from mimo_sft.train.export import export_checkpoint

    try:
        path = export_checkpoint(checkpoint, out, hf_model=hf_model, adapter_only=adapter_only, dtype=dtype,
                                 shard_size=shard_size)
    except UserError as e:
        _fail(e)
    _say_lora("export", checkpoint)
    make_console().print(f"wrote {'PEFT adapter' if adapter_only else 'Hugging Face checkpoint'} to {path}")


@app.command()
def generate(
    target: str = typer.Argument(..., metavar="CHECKPOINT|HF_FOLDER",
                                 help="a mimo-sft checkpoint folder (or its parent with 'latest'), or a Hugging Face folder"),
    prompts: str = typer.Option(..., "--prompts", help="prompt rows in any training format (messages, ShareGPT/LLaVA), without the answer"),
    out: str = typer.Option(..., "--out", help="the .jsonl file to write: one object per prompt, in order, with 'answer'"),
    hf_model: Optional[str] = typer.Option(None, "--hf-model", help="the checkpoint's base HF folder (default: the one it records)"),
    max_new_tokens: int = typer.Option(Decoding.max_new_tokens, "--max-new-tokens", help="the most tokens an answer may have"),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy (the default); above 0: sampling at this temperature"),
    top_p: float = typer.Option(1.0, "--top-p", help="sampling: keep the most likely tokens up to this probability mass"),
    seed: int = typer.Option(0, "--seed", help="sampling: torch's seed, set before each prompt"),
    compare_base: bool = typer.Option(False, "--compare-base", help="also write the base model's answers, as 'base_answer'"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32 or bf16 (default: the run's training --dtype, as export; an HF folder: its config's)"),
    image_root: Optional[str] = typer.Option(None, "--image-root", help="folder relative image paths resolve against (default: the prompts file's)"),
    cpu: bool = typer.Option(False, "--cpu", help="run on the CPU even where a GPU is available"),
) -> None:
    """Answer prompts with a checkpoint through transformers' generate (its weights converted in memory, as export converts them)."""
    from mimo_sft.quiet import quiet_libraries

    quiet_libraries()
    from mimo_sft.generate import generate as run_generate

    try:
        n = run_generate(target, prompts, out, hf_model=hf_model, dtype=dtype, compare_base=compare_base,
                         decoding=Decoding(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed),
                         image_root=image_root, prefer="cpu" if cpu else "auto")
    except UserError as e:
        _fail(e)
    _say_lora("generate", target)
    make_console().print(f"wrote {n} answer{'s' if n != 1 else ''} to {out}")


def _say_lora(command: str, path: str) -> None:
    """One line when ``path`` is a LoRA checkpoint: export and generate take its LoRA settings (they have no flags)."""
    from mimo_sft.config.checks.checkpoint import find_meta
    from mimo_sft.config.lora import describe_lora

    lora = (find_meta(path) or {}).get("lora") if os.path.isdir(path) else None
    if lora:
        print(f"mimo-sft {command}: LoRA settings from the checkpoint: {describe_lora(lora)}")


checkpoint_app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                             help="Inspect mimo-sft checkpoints.")
app.add_typer(checkpoint_app, name="checkpoint")


@checkpoint_app.command("info")
def checkpoint_info(
    folder: str = typer.Argument(..., help="a mimo-sft checkpoint folder (or its parent with 'latest')"),
    component: list[str] = typer.Option([], "--component", help="a layout to ask about, as for finetune: NAME=k=v,... (repeat)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    verify: bool = typer.Option(False, "--verify", help="also check every file a load would read: each pickle through "
                                "the restricted readers, each data file's size against the metadata (no tensor is loaded)"),
) -> None:
    """Step, layout, dtype, optimizer, sizes per module -- and whether it resumes on --component's layout. Reads no tensor."""
    from mimo_sft.parallel.components import parse_component
    from mimo_sft.train.checkpoint.info import describe, format_info

    try:
        info = describe(folder, [parse_component(c) for c in component] or None, verify=verify)
    except UserError as e:
        _fail(e)
    print(json.dumps(info) if as_json else format_info(info))
    if not info.get("resumes_on", {"ok": True})["ok"]:
        raise typer.Exit(1)


PLAN_FLAGS = {"--steps": "micro-batches to simulate (default 50)", "--out": "folder for the PNG",
              "--json": "print the figures as one JSON object",
              "--compare-window": "comma-separated window sizes to compare, e.g. 1,2,4",
              "--compare-cost-weights": "comma-separated language cost weights to compare, e.g. 0,0.5"}


@app.command(context_settings=FLAG_COMMAND)
def plan(ctx: typer.Context) -> None:
    """Show, before any GPU time, what reordering will do to each rank's load on your data."""
    import mimo_sft.plan as planner

    _run_flag_command("plan", ctx, lambda args: planner.run_plan(args), PLAN_FLAGS)


@app.command("check-data", context_settings=FLAG_COMMAND)
def check_data(ctx: typer.Context) -> None:
    """Decode every sample once, as training would; list every problem with its sample and file, and counts."""
    from mimo_sft.check_data import CHECK_DATA_FLAGS, run_check_data

    _run_flag_command("check-data", ctx, run_check_data, CHECK_DATA_FLAGS)


@app.command()
def summarize(
    run: str = typer.Argument(..., help="a run folder (the finetune's --output-dir)"),
    png: bool = typer.Option(False, "--png", help="also write the plot of the ranks' work per step to "
                             "RUN/rank_spread.png"),
    png_path: Optional[str] = typer.Option(None, "--png-path", help="write the plot here instead (implies --png)"),
) -> None:
    """A run's metrics.jsonl in a few lines, a per-rank table of where the time went, (--png) a plot of its spread."""
    from mimo_sft.summary import summarize as run_summary

    try:
        lines = run_summary(run, png_path or ("" if png else None))
    except UserError as e:
        _fail(e)
    print("\n".join(lines))


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    app()


if __name__ == "__main__":
    main()
