"""Every mimo-sft command in README.md and docs/*.md runs as the page says (issue 44 item 6), so the docs
cannot rot: a renamed flag, a config that no longer validates, a refusal whose words changed, fails here.

What is read: the ```bash, ```sh and ```console blocks. A command is a line (``\\`` continues it) that calls
``mimo-sft`` (``.venv/bin/mimo-sft`` too), ``python -m mimo_sft`` or ``torchrun ... -m mimo_sft``; other lines
(``make``, ``pip``, ``scripts/...``) are not mimo-sft's and are left alone. In a console block a command starts
with ``$ ``, and the lines after it are what it prints: each must appear in its output (spaces collapsed,
``...`` stands for any text). A trailing comment sets what is expected of the command:

* ``# exit N``: it exits N (a refusal the page shows); without it, 0;
* ``# gpu``: it cannot run on a CPU at all, and is not run here (none needs it today).

How each runs, on the CPU, in this process (Typer's runner), in a fresh working folder:

* ``finetune`` and ``evaluate`` start no workers: their launcher flags go through the launcher's own parser
  (``train.elastic.split_launch_flags``: its refusals are the launcher's), and the rest through ``mimo-sft
  validate --world-size N`` -- the same config checks the launcher runs before it starts N workers. Without a
  launcher (no ``--nproc-per-node``, no torchrun) the run's own refusal follows
  (``parallel.bootstrap.require_launcher``); a one-process ``evaluate`` passes with its checks. ``evaluate``'s
  arguments are what its ranks check (``train.evaluate.evaluate_args``: the checkpoint as
  ``--pretrained-checkpoint``, its base model, one process without ``--component``).
* every other command (``validate``, ``plan``, ``check-data``, ``check-model``, ``checkpoint info``, ``export``,
  ``generate``, ``--help``) runs as written.

The pages' placeholder paths (``PLACEHOLDERS``) become tiny inputs made here: the tiny Qwen2.5-VL (and a wide
and a mixture-of-experts variant for the layouts that need more heads or experts), small datasets in every
format the pages name, and two checkpoints saved as a run saves its model (one full, one LoRA) whose meta.json
is the one the pages' training command would write. GPU-sized layouts validate on the CPU because validate
only checks the config: it starts no process.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from data_fixtures import demo_dataset_dir, tiny_checkpoint_dir

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
pytestmark = pytest.mark.xdist_group("docs_commands")  # one worker builds the inputs once

#: doc path (or prefix, ending in "/") -> the input made here: a fixture name, or a value
PLACEHOLDERS = {
    "/models/Qwen2.5-VL-7B-Instruct": "tiny",
    "/models/Qwen2.5-VL-72B-Instruct": "tiny_wide",   # 8 KV heads: the 72B config's language tp 8 divides them
    "/models/Qwen3-VL-30B-A3B-Instruct": "tiny_moe",  # 8 experts: ep 8 divides them
    "demo/tiny-qwen2.5-vl": "tiny",                   # what `make demo` writes
    "demo/data": "demo",
    "demo/run": "demo_run",                           # the demo's first run: its metrics for --reorder-calibrate-from
    "/models/": "missing",                            # any other model folder: not there
    "/data/": "data",
    "/shared/": "shared",
    "$NODE_RANK": "0",
    "$MASTER_ADDR": "127.0.0.1",
}
#: the config of the pages' training command: the checkpoints made here are those its run writes
RUN_ARGS = ["--config", str(ROOT / "configs/qwen25vl_7b_8gpu_noncolocated.yaml")]
LAUNCH_COMMANDS = ("finetune", "evaluate")
SUBCOMMANDS = ("validate", "finetune", "evaluate", "check-model", "export", "generate", "plan", "check-data",
               "checkpoint")


@dataclass
class DocCommand:
    where: str
    line: str
    args: list[str]            # after the mimo-sft program
    torchrun_world: int | None = None
    exit: int = 0
    gpu: bool = False
    console: bool = False
    output: list[str] = field(default_factory=list)


def _split_comment(line: str) -> tuple[str, str]:
    """(code, comment): the first ``#`` outside quotes that starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:]
    return line, ""


def _mimo_args(tokens: list[str]) -> tuple[list[str], int | None] | None:
    """(mimo-sft's arguments, torchrun's world size) of a command line's tokens; None: not a mimo-sft command."""
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
        tokens = tokens[1:]  # VAR=value before the program
    if not tokens:
        return None
    prog = os.path.basename(tokens[0])
    if prog == "mimo-sft":
        return tokens[1:], None
    if tokens[1:3] == ["-m", "mimo_sft"] and re.match(r"^python(3(\.\d+)?)?$", prog):
        return tokens[3:], None
    if prog == "torchrun" and "mimo_sft" in tokens:
        at = tokens.index("mimo_sft")
        flags = dict(re.match(r"^(--[\w-]+)=?(.*)$", t).groups() for t in tokens[1:at] if t.startswith("--") and "=" in t)
        flags.update({a: b for a, b in zip(tokens[1:at], tokens[2:at]) if a.startswith("--")})
        nproc = int(flags.get("--nproc-per-node", flags.get("--nproc_per_node", 1)))
        return tokens[at + 1:], nproc * int(flags.get("--nnodes", 1))
    return None


def doc_commands() -> tuple[list[DocCommand], list[str]]:
    """Every mimo-sft command of the pages, and the lines that name a mimo-sft command but were not understood."""
    found, unread = [], []
    for page in PAGES:
        text = page.read_text()
        for block in re.finditer(r"^```(bash|sh|console)\n(.*?)^```", text, re.M | re.S):
            start = text[:block.start()].count("\n") + 2
            lines, console = block.group(2).split("\n"), block.group(1) == "console"
            current = None
            i = 0
            while i < len(lines):
                first, raw = i, lines[i]
                while raw.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    raw = raw.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
                if console and not raw.startswith("$ "):
                    if current is not None and raw.strip():
                        current.output.append(raw.strip())
                    continue
                code, comment = _split_comment(raw[2:] if console else raw)
                if not code.strip():
                    continue
                parsed = _mimo_args(shlex.split(code))
                where = f"{page.relative_to(ROOT)}:{start + first}"
                if parsed is None:
                    current = None
                    if re.search(r"(mimo-sft|-m mimo_sft)\s+(" + "|".join(SUBCOMMANDS) + r")\b", code):
                        unread.append(f"{where}: {code.strip()}")
                    continue
                expected = re.search(r"\bexit (\d+)\b", comment)
                current = DocCommand(where, code.strip(), parsed[0], parsed[1], int(expected.group(1)) if expected else 0,
                                     bool(re.search(r"\bgpu\b", comment)), console)
                found.append(current)
    return found, unread


COMMANDS, UNREAD = doc_commands()


def test_every_mimo_sft_line_of_the_docs_is_a_command_this_test_runs():
    assert not UNREAD, "lines that call mimo-sft in a form this test does not read (teach _mimo_args):\n" + "\n".join(UNREAD)
    pages = {c.where.split(":")[0] for c in COMMANDS}
    for page in ("README.md", "docs/data.md", "docs/layouts.md", "docs/checkpoints.md", "docs/lora.md",
                 "docs/evaluation.md", "docs/troubleshooting.md", "docs/memory.md", "docs/training.md"):
        assert page in pages, f"{page} has no command left"
    refusals = [c for c in COMMANDS if c.exit]
    assert len(refusals) >= 10, "troubleshooting.md shows the refusals a user meets"
    assert not [c.where for c in refusals if c.console and not c.output], "a refusal in a console block shows its line"


# --------------------------------------------------------------------------- the inputs behind the placeholders


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _messages_rows(folder: Path, prefix: str, samples: int, seed: int) -> list[dict]:
    """The demo's rows (text-only, one and several images) with their images as files under ``folder/prefix``,
    named by relative path."""
    from mimo_sft.testing.demo_data import demo_rows

    rows = []
    for k, row in enumerate(demo_rows(samples, seed=seed)):
        names = []
        for j, img in enumerate(row["images"]):
            name = f"{prefix}{1000 + 10 * k + j:04d}.png"  # never receipts/0002.png: broken.jsonl's missing file
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(img["bytes"])
            names.append(name)
        content = [{k2: v for k2, v in part.items() if v is not None} for part in row["messages"][0]["content"]]
        rows.append({"messages": [{"role": "user", "content": content}, row["messages"][1]], "images": names})
    return rows


def _data_folder(root: Path) -> Path:
    """/data: the files the pages name."""
    from mimo_sft.testing.demo_data import write_demo_dataset

    rows = _messages_rows(root, "receipts/", 16, seed=1)
    for name in ("sft.jsonl", "val.jsonl", "ocr.jsonl", "ocr_val.jsonl"):
        _write_jsonl(root / name, rows)
    _write_jsonl(root / "receipts/train.jsonl", [dict(r, images=[n.split("/", 1)[1] for n in r["images"]]) for r in rows])
    one = next(r for r in rows if len(r["images"]) == 1)
    _write_jsonl(root / "broken.jsonl", [one, dict(one, images=["receipts/0002.png"])])  # sample 1: no such file
    shutil.copy(root / one["images"][0], root / "image.png")  # the prompt's image
    llava = [{"id": str(k), "image": f"{k}.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat colour is it?"}, {"from": "gpt", "value": "Red."}]} for k in range(4)]
    (root / "llava/images").mkdir(parents=True)
    for k in range(4):
        shutil.copy(root / "image.png", root / f"llava/images/{k}.png")
    (root / "llava/llava_instruct.json").write_text(json.dumps(llava))
    write_demo_dataset(root / "sft.parquet", samples=24, seed=2)
    for name in ("docs.parquet", "docs_val.parquet", "chat.parquet"):
        shutil.copy(root / "sft.parquet", root / name)
    for name in ("chat", "chat_val"):
        (root / name).mkdir()
        shutil.copy(root / "sft.parquet", root / name / "train.parquet")
    return root


def _shared_folder(root: Path) -> Path:
    """/shared: parquet shards and WebDataset tars, read in place; one global batch of the pages' config (96 rows:
    validate counts a streamed source's rows, as start-up does)."""
    from mimo_sft.testing.demo_data import demo_rows, write_shards

    rows = demo_rows(96, seed=3)
    write_shards(rows, root / "docs", shards=2)
    write_shards(rows, root / "web", shards=2, kind="webdataset")
    return root


def _save_checkpoint(model, folder: Path, meta: dict) -> Path:
    """``model``'s weights as a run's checkpoint holds them, its meta.json and ``latest`` beside them."""
    from mimo_sft.train.checkpoint.model import model_sharded_state_dict  # before megatron: mimo_sft's shims

    from megatron.core import dist_checkpointing

    step = folder / f"iter_{meta['step']:07d}"
    (step / "model").mkdir(parents=True)
    dist_checkpointing.save(model_sharded_state_dict(model), str(step / "model"))
    (step / "meta.json").write_text(json.dumps(meta))
    (folder / "latest").write_text(step.name + "\n")
    return folder


def _run_meta(args: list[str], step: int) -> dict:
    """The meta.json a run of ``args`` writes at ``step`` (its layout, optimizer form, data order, LoRA spec)."""
    from mimo_sft.config.checks.checkpoint import data_order_meta, resolved_path
    from mimo_sft.config.loader import load_config
    from mimo_sft.config.lora import distributed_optimizer_in_use
    from mimo_sft.config.recorded import schedule_meta
    from mimo_sft.train.checkpoint.lora import lora_meta
    from mimo_sft.train.checkpoint.model import layout_signature
    from mimo_sft.train.checkpoint.optimizer import save_format
    from mimo_sft.validate import check_config

    cfg = load_config(args)
    result = check_config(cfg)
    assert result.ok, result.problems
    fmt = save_format(cfg)
    return {"step": step, "consumed_samples": step * cfg.train.global_batch_size,
            "world_size": result.layout.world_size, "layout": layout_signature(result.layout),
            "hf_model": resolved_path(cfg.model.hf_model), "use_distributed_optimizer": distributed_optimizer_in_use(cfg),
            "dtype": cfg.model.dtype, **({"distributed_optimizer_format": fmt} if fmt else {}),
            **lora_meta(cfg.model), **data_order_meta(cfg), **schedule_meta(cfg)}


def _checkpoints(root: Path, tiny: Path, data: Path) -> dict[str, Path]:
    """runs/exp1/checkpoints (full) and runs/lora/checkpoints (LoRA r 16, alpha 32, frozen tower), saved from
    the tiny model built as those runs build it."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.config.lora import LoraSpec
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.lora import apply_lora

    full = RUN_ARGS + ["--hf-model", str(tiny), "--dataset-path", str(data / "sft.jsonl")]
    lora = full + ["--lora-rank", "16", "--lora-alpha", "32", "--freeze-vision", "--freeze-projector"]
    lora_cfg = load_config(lora)
    model, _ = build_single_process_model(str(tiny), model_cfg=lora_cfg.model)
    out = {"exp1": _save_checkpoint(model, root / "exp1", _run_meta(full, 4))}
    apply_lora(model, LoraSpec.from_model_config(lora_cfg.model), seed=lora_cfg.train.seed)
    out["lora"] = _save_checkpoint(model, root / "lora", _run_meta(lora, 4))
    return out


def _run_with_phases(folder: Path) -> Path:
    """A 2-rank run's metrics.jsonl with the straggler report's per-rank phases and work (what a real run logs)."""
    import json

    from mimo_sft.parallel.components import parse_component
    from mimo_sft.parallel.layout import Layout
    from mimo_sft.train.straggler import PHASES, ROW, StragglerReport

    layout = Layout.from_specs([parse_component("language=dp=2,rank_offset=0"), parse_component("images=dp=2,rank_offset=2")])
    report = StragglerReport(rank=0, world_size=4, layout=layout, log_interval=1, total_steps=4, threshold=9.0,
                             hosts=["h"] * 4)
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as fh:
        for step in range(1, 5):
            block = []
            for rank in range(4):
                row, load = [0.0] * ROW, 1000.0 * (step + rank)
                phase = "language forward" if rank < 2 else "encoder forward"
                row[1 + PHASES.index(phase)] = 0.01 + 2e-5 * load
                row[1 + len(PHASES):] = [0.0, load] if rank < 2 else [load, 0.0]
                block += row
            fh.write(json.dumps({"step": step, "loss": 7.0 - step / 10, "step_time_s": 0.2, "tokens_per_s": 900.0,
                                 "world_size": 4, **report.analyse(step, block)}) + "\n")
    return folder


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Folder names and values behind ``PLACEHOLDERS`` (models made on first use), and the checkpoints."""
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("docs_inputs")
    tiny = tiny_checkpoint_dir()
    data = _data_folder(root / "data")
    made = {"tiny": tiny, "demo": demo_dataset_dir(), "data": data, "shared": _shared_folder(root / "shared"),
            "missing": root / "no-such-models"}
    lazy = {"tiny_wide": lambda: write_tiny_checkpoint(root / "tiny_wide", heads=8, kv_heads=8),
            "tiny_moe": lambda: write_tiny_checkpoint(root / "tiny_moe", family="qwen3_vl_moe"),
            "demo_run": lambda: _run_with_phases(root / "demo_run")}
    prompts = _write_jsonl(root / "prompts.jsonl", [{"messages": [{"role": "user", "content": [
        {"type": "image", "image": str(data / "image.png")}, {"type": "text", "text": "What is the total?"}]}]}])

    def get(name: str) -> Path:
        if name not in made:
            made[name] = lazy[name]()
        return made[name]

    return {"get": get, "checkpoints": _checkpoints(root / "runs", tiny, data), "prompts": prompts}


def _substitute(token: str, get) -> str:
    for key in sorted(PLACEHOLDERS, key=len, reverse=True):
        value = PLACEHOLDERS[key]
        if key.startswith("$") and key in token:
            return token.replace(key, value)
        if token == key or (key.endswith("/") and token.startswith(key)) or token.startswith(key + "/"):
            return str(get(value)) + token[len(key.rstrip("/")):]
    if token.startswith("configs/"):
        return str(ROOT / token)
    assert "$" not in token, f"{token}: a shell variable without a value in PLACEHOLDERS"
    return token


def _workdir(tmp_path: Path, inputs: dict) -> Path:
    """A fresh working folder holding what the pages' relative paths name: two runs' checkpoints and prompts."""
    for name, ckpt in inputs["checkpoints"].items():
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "checkpoints").symlink_to(ckpt)
    shutil.copy(inputs["prompts"], tmp_path / "prompts.jsonl")
    return tmp_path


# --------------------------------------------------------------------------- running a command


def _invoke(args: list[str]) -> tuple[int, str]:
    from mimo_sft.cli import app

    res = CliRunner().invoke(app, args)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception  # a bug, not a refusal: keep its traceback
    return res.exit_code, res.output


def _launch_check(cmd: DocCommand, args: list[str]) -> tuple[int, str]:
    """What ``finetune`` / ``evaluate`` decide before they start a worker: the launcher's flags, then every check
    for the world it would start (validate), then -- without a launcher -- the run's own refusal."""
    from mimo_sft.errors import UserError
    from mimo_sft.parallel.bootstrap import require_launcher
    from mimo_sft.train.elastic import split_launch_flags

    if "--help" in args:
        return _invoke([cmd.args[0], "--help"])
    try:
        opts, rest = split_launch_flags(args[1:])
    except UserError as e:
        return 2, f"error: {e}"
    world = opts.world_size if opts else cmd.torchrun_world
    if cmd.args[0] == "evaluate":  # as its ranks check them
        from mimo_sft.train.evaluate import evaluate_args

        rest, _ = evaluate_args(rest, world or 1)
    code, out = _invoke(["validate", "--json", *rest, *(["--world-size", str(world)] if world else [])])
    if code == 2 and not out.lstrip().startswith("{"):
        return code, out  # a flag the loader refused
    verdict = json.loads(out)
    if not verdict["ok"]:
        return 2, "".join(f"error: {p}\n" for p in verdict["problems"])
    if world is None:
        try:
            require_launcher(verdict["world_size"])
        except UserError as e:
            return 2, f"error: {e}"
        if cmd.args[0] == "evaluate":  # one process, no launcher: what it checks before it loads the weights
            return 0, out
        raise AssertionError(f"{cmd.where}: a {cmd.args[0]} of one rank without a launcher would train here")
    return 0, out


def _normalised(text: str) -> str:
    return " ".join(text.split())


def _shows(output: str, expected: str) -> bool:
    """Whether ``expected`` (``...``: any text) appears in ``output``, spaces collapsed."""
    pattern = ".*?".join(re.escape(_normalised(part)) for part in expected.split("..."))
    return re.search(pattern, _normalised(output)) is not None


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_doc_command(cmd: DocCommand, inputs, tmp_path, monkeypatch):
    if cmd.gpu:
        pytest.skip("marked '# gpu' in the page: needs a GPU")
    monkeypatch.chdir(_workdir(tmp_path, inputs))
    args = [_substitute(a, inputs["get"]) for a in cmd.args]
    if args and args[0] in LAUNCH_COMMANDS:
        code, out = _launch_check(cmd, args)
    else:
        code, out = _invoke(args)
    assert code == cmd.exit, f"{cmd.where}: `{cmd.line}` exited {code}, the page says {cmd.exit}:\n{out[-3000:]}"
    missing = [line for line in cmd.output if not _shows(out, line)]
    assert not missing, f"{cmd.where}: `{cmd.line}` did not print {missing}; it printed:\n{out[-3000:]}"


#: pages linked before they exist (none now)
PENDING_PAGES: set = set()


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_links_between_the_pages_resolve():
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)?(?:#([^)\s]+))?\)", page.read_text()):
            path = (page.parent / target).resolve() if target else page
            if not target and not anchor:
                continue
            if path in PENDING_PAGES and not path.exists():
                continue
            if not path.exists() or (anchor and anchor not in _anchors(path)):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, "links to pages or headings that do not exist:\n" + "\n".join(broken)
