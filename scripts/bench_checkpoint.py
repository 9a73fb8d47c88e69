"""Checkpoint saves at a few hundred million parameters: host memory, save time, and the training
step while a background save is written; and (``--suite load``) host memory while loading the
Hugging Face weights.

    .venv/bin/python scripts/bench_checkpoint.py [--text-hidden 1024] [--text-layers 12] [--nproc 2] [--save-before GIT_REV]
    .venv/bin/python scripts/bench_checkpoint.py --suite load
    .venv/bin/python scripts/bench_checkpoint.py --suite export [--before GIT_REV] [--lora]
    .venv/bin/python scripts/bench_checkpoint.py --suite gil

``--suite gil``: whether the async save's writer thread slows a Python-bound loop (the GIL; in this
process, no model): :func:`gil_suite`.

``--suite load``: 2 colocated ranks, language tp 2 + images dp 2, the same model with its
safetensors weights. Each rank's peak extra RSS while its language weights are copied into the built
model (reading included) -- all of it, and the anonymous part (RssAnon: without the safetensors
file pages the reader maps, which are page cache the kernel can drop) -- streamed one decoder layer at a time (now) and with the rank's whole
stage read first (before; the same reader, its groups merged into one dict).

``--suite export``: one CPU rank fine-tunes the same model for one step (fp32) and saves; then
``mimo-sft export``'s function writes that checkpoint as a Hugging Face folder (fp32 and bf16, 200MB
shards, and bf16 in 50MB shards) in a fresh process per row, sampled as above (peak extra RSS over the process's RSS before
the export, its anonymous part, and the time). ``--before GIT_REV`` (default ``9b562d4``, main before
the streamed export) runs the same call on that revision's code (a ``git archive`` copy): the export
that built the whole model in host memory. ``--lora``: the step is a LoRA run's (``--lora-rank 8``:
language adapters, the vision tower training) and the export merges it; before ``b8ace25`` that merge
built the whole model in host memory.

Writes a Qwen2.5-VL whose language model is real-width (``make_tiny_qwen_vl.py --text-hidden 1024
--text-layers 12 --intermediate 4096``: about 0.19B language parameters; the vision tower stays
tiny) and the synthetic document dataset, then runs ``--nproc`` CPU ranks (colocated, language dp N,
images dp N, distributed optimizer, fp32) under torchrun. Each rank builds the real trainer, trains
one step (so Adam state exists), saves four ways into fresh folders, and after each save resumes from it
(``load_checkpoint`` into the same trainer: weights, optimizer state, RNG):

* ``--save-reshardable``: the form that resumes on any layout (megatron's gather of the module's whole
  optimizer state on every DP rank before issue 33; each rank's own shard as boxes now), and its resume
  (before: every rank reading the module's whole state; now: its own shard);
* the same with ``--async-save``;
* ``dp_reshardable`` (the default): each rank writes its own shards, no gather; and with ``--async-save``:
  from the save's own host copy, written by a thread of the training process while the rank trains on;
  the save is published by the first poll after every rank's writer is done.

``--save-before GIT_REV``: the same rows first with that revision's mimo_sft (a ``git archive`` copy).
A sampler thread reads this process's RSS (and the private memory, USS, of any process started
during the save: the forked writer of older revisions, run with ``BENCH_MIMO_TREE``) every 20 ms. Per rank it prints the rank's own state (its parameters, gradient buffer and
optimizer shard, counted from the tensors), the peak extra RSS during the save over the RSS just
before it, the writer's peak USS, and the time the save blocked training (for the async save: the
call, then the whole write until publication), and the extra RSS when the call returned (the async
save's own copy). On the CPU the device memory is the host memory, so
"extra device memory" is the same column. Then three training steps without a save and at least two while
the async save is in flight: their median times, and per step the training thread's CPU time, its
wait for a CPU and its page faults.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the mimo_sft code measured: this checkout, or (``--before``'s rows) a ``git archive`` of an older revision
sys.path.insert(0, os.environ.get("BENCH_MIMO_TREE") or ROOT)
from mimo_sft.testing.bench_runs import bench_env, run_session  # noqa: E402


def _rss_anon() -> int:
    """Anonymous resident memory (RssAnon): RSS without file pages mapped from the safetensors files,
    which the kernel can drop at any time."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Peak RSS of this process and peak USS of its children, sampled in a thread."""

    def __init__(self, interval_s: float = 0.02):
        import psutil

        self.proc, self.interval = psutil.Process(), interval_s
        self.base = self.proc.memory_info().rss
        self.before = {c.pid for c in self.proc.children(recursive=True)}  # megatron's results-queue manager
        self.peak, self.child_peak = self.base, 0
        self.anon_base = self.anon_peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import psutil

        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.anon_peak = max(self.anon_peak, _rss_anon())
            for child in self.proc.children(recursive=True):
                if child.pid in self.before:
                    continue
                try:
                    self.child_peak = max(self.child_peak, child.memory_full_info().uss)
                except psutil.Error:
                    pass
            self._stop.wait(self.interval)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base, self.child_peak


def _own_state_bytes(ctx) -> int:
    """This rank's parameters, gradient buffers and optimizer state tensors (each storage once)."""
    import torch

    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()

    for p in ctx.model.parameters():
        add(p)
        add(getattr(p, "main_grad", None))
    for info in ctx.optimizer.module_infos.values():
        opt = info.optimizer if info.is_active else None
        for inner in getattr(opt, "chained_optimizers", [opt] if opt else []):
            for group in inner.optimizer.param_groups:
                for p in group["params"]:
                    add(p)
            for state in inner.optimizer.state.values():
                for v in state.values():
                    add(v)
    return total


def _run_queue_wait() -> float:
    """Seconds this thread has waited, runnable, for a CPU (``/proc/thread-self/schedstat``'s second field)."""
    with open("/proc/thread-self/schedstat") as fh:
        return int(fh.read().split()[1]) / 1e9


def _timed_step(trainer) -> tuple[float, int, float, float]:
    """One training step: (wall seconds, minor page faults of the training thread, its CPU seconds, its
    seconds waiting for a CPU) -- the thread's own (``RUSAGE_THREAD``), not the background writer's,
    which runs in the same process."""
    import resource

    r0, q0, t0 = resource.getrusage(resource.RUSAGE_THREAD), _run_queue_wait(), time.perf_counter()
    trainer.train_step()
    r1, q1 = resource.getrusage(resource.RUSAGE_THREAD), _run_queue_wait()
    return (time.perf_counter() - t0, r1.ru_minflt - r0.ru_minflt, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
            q1 - q0)


#: the save suite's saves: (row name, --save-reshardable, --async-save); the last one is an async save (the
#: step times while it is written are measured)
SAVES = (("--save-reshardable", True, False), ("--save-reshardable, --async-save", True, True),
         ("dp_reshardable (the default)", False, False), ("dp_reshardable, --async-save", False, True))


def _measured_save(trainer, ctx, folder: str, reshardable: bool, background: bool) -> tuple:
    """One save (then the steps that run while it is written) and the resume from it: (peak extra RSS,
    extra RSS when the call returned, writer USS, blocked s, until published s, step times, load peak
    extra RSS, load s)."""
    import torch.distributed as dist

    from mimo_sft.train.checkpoint.save import load_checkpoint, save_checkpoint
    from mimo_sft.train.checkpoint.write import PendingSaves

    ctx.cfg.checkpoint.save_reshardable = reshardable
    dist.barrier()
    pending = PendingSaves() if background else None
    published = []
    mem = PeakMemory()
    t0 = time.perf_counter()
    path = save_checkpoint(folder, step=trainer.step, consumed_samples=trainer.consumed, ctx=ctx, pending=pending,
                           on_published=published.append)
    blocked = time.perf_counter() - t0
    staged = mem.proc.memory_info().rss - mem.base  # the save's own copies, before any step runs
    during = []
    if background:
        while not published or len(during) < 2:
            during.append(_timed_step(trainer))
            pending.poll()
        pending.wait()
    total = time.perf_counter() - t0
    extra, child = mem.stop()
    dist.barrier()
    mem = PeakMemory()
    t0 = time.perf_counter()
    load_checkpoint(path or published[0], ctx)  # every rank reads what this layout needs of it
    load_s = time.perf_counter() - t0
    load_extra, _ = mem.stop()
    return extra, staged, child, blocked, total, during, load_extra, load_s


def worker(args: list[str], out_dir: str) -> int:
    import torch.distributed as dist

    from mimo_sft.validate import require_valid
    from mimo_sft.config.loader import load_config
    from mimo_sft.quiet import quiet_libraries
    from mimo_sft.train.trainer import Trainer

    quiet_libraries()
    cfg = load_config(args)
    trainer = Trainer(cfg, require_valid(cfg, for_run=True).layout)
    trainer.setup()
    trainer.train_step()
    ctx, rank = trainer.ctx, dist.get_rank()
    rows = []
    for i, (name, reshardable, background) in enumerate(SAVES[-1:] if os.environ.get("BENCH_ASYNC_ONLY") else SAVES):
        rows.append((name, *_measured_save(trainer, ctx, os.path.join(out_dir, f"save_{i}"), reshardable, background)))
    normal = [_timed_step(trainer) for _ in range(3)]
    own = _own_state_bytes(ctx)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rank, own, rows, normal), group=trainer.pstate.world_gloo)
    if rank == 0:
        _print_table(gathered, os.environ.get("BENCH_LABEL", "now"))
    trainer.close()
    trainer.shutdown()
    return 0


def load_worker(args: list[str], label: str) -> int:
    """Peak extra RSS of this rank while ``build_mimo_model`` allocates the model and reads its weights,
    over the RSS just before; what stays after it (the model); its parameters' bytes."""
    import torch.distributed as dist

    import mimo_sft.model.builder as builder
    from mimo_sft.validate import require_valid
    from mimo_sft.config.loader import load_config
    from mimo_sft.quiet import quiet_libraries
    from mimo_sft.train.trainer import Trainer

    quiet_libraries()
    build, seen = builder.build_mimo_model, []

    def measured(*a, **kw):
        mem = PeakMemory()
        model, info = build(*a, **kw)
        after = mem.proc.memory_info().rss - mem.base
        rss, _ = mem.stop()
        seen.append((rss, after, mem.anon_peak - mem.anon_base, sum(p.numel() * p.element_size() for p in model.parameters())))
        return model, info

    builder.build_mimo_model = measured
    cfg = load_config(args)
    trainer = Trainer(cfg, require_valid(cfg, for_run=True).layout)
    trainer.setup()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dist.get_rank(), seen[0]), group=trainer.pstate.world_gloo)
    if dist.get_rank() == 0:
        mb = 2 ** 20
        for rank, (rss, after, anon, params) in sorted(gathered):
            print(f"| {label} | {rank} | {params / mb:.0f} | {rss / mb:.0f} | {anon / mb:.0f} | {after / mb:.0f} "
                  f"| {(rss - after) / mb:.0f} |")
    trainer.close()
    trainer.shutdown()
    return 0


def load_suite(a, py, env, work, model, data) -> None:
    args = ["--hf-model", model, "--dataset-path", data, "--seq-length", str(a.seq_length), "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "1", "--no-tensorboard", "--component", "language=tp=2,dp=1",
            "--component", "images=dp=2", "--dtype", "bf16"]
    torchrun = os.path.join(os.path.dirname(py), "torchrun")
    before = _archive(a.before, work)
    print("| weights load | rank | rank's parameters MB (bf16) | peak extra RSS while building + loading MB "
          "| of it anonymous (RssAnon) MB | extra RSS after MB | transient (peak - after) MB |")
    print("|---|---|---|---|---|---|---|")
    for label, tree in ((f"before ({a.before})", before), ("now", ROOT)):
        log = os.path.join(work, f"load_{os.path.basename(tree)}.log")
        run_session([torchrun, "--nproc-per-node", "2", "scripts/bench_checkpoint.py", "--load-worker", label, *args,
                     "--output-dir", os.path.join(work, f"run_{os.path.basename(tree)}")], cwd=ROOT,
                    env=dict(env, BENCH_MIMO_TREE=tree), log=log)
        print("\n".join(ln for ln in open(log).read().splitlines() if ln.startswith(f"| {label} |")))


def _archive(rev: str, work: str) -> str:
    """``rev``'s mimo_sft package, unpacked under ``work`` (the 'before' rows run it)."""
    out = os.path.join(work, "before")
    if not os.path.isdir(out):
        os.makedirs(out)
        subprocess.run(f"git archive {rev} mimo_sft | tar -x -C {out}", shell=True, check=True, cwd=ROOT)
    return out


EXPORT_WORKER = """
import sys, time
sys.path.insert(0, {tree!r})
import mimo_sft  # this revision's package, imported before the bench script puts its own first
sys.path.insert(0, {scripts!r})
import bench_checkpoint as bench
bench.export_worker({ckpt!r}, {out!r}, {label!r}, {dtype!r}, {shard!r}, {adapter_only!r})
"""


def export_worker(ckpt: str, out: str, label: str, dtype: str, shard_size: str = "200MB", adapter_only: bool = False) -> None:
    import inspect

    from mimo_sft.train.export import export_checkpoint
    from mimo_sft.quiet import quiet_libraries

    quiet_libraries()
    import mimo_sft.parallel  # noqa: F401  (megatron imports through its triton stand-in)
    import megatron.core  # noqa: F401  the libraries' own memory is in the baseline, not in the export's figure
    import mimo_sft.model.builder  # noqa: F401
    import mimo_sft.train.checkpoint.save  # noqa: F401
    from transformers import AutoModelForImageTextToText  # noqa: F401

    kw = {"shard_size": shard_size} if "shard_size" in inspect.signature(export_checkpoint).parameters else {}
    if adapter_only:
        kw = {"adapter_only": True}
    mem = PeakMemory()
    t0 = time.perf_counter()
    export_checkpoint(ckpt, out, dtype=dtype, **kw)
    seconds = time.perf_counter() - t0
    rss, _ = mem.stop()
    files = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    print(f"| {label} | {dtype} | {len(files)} | {rss / 2 ** 20:.0f} | {(mem.anon_peak - mem.anon_base) / 2 ** 20:.0f} "
          f"| {seconds:.1f} |", flush=True)


def export_suite(a, py, env, work, model, data) -> None:
    args = ["--hf-model", model, "--dataset-path", data, "--seq-length", str(a.seq_length), "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--no-tensorboard", "--component", "language=dp=1",
            "--component", "images=dp=1", "--output-dir", os.path.join(work, "run"),
            *(["--lora-rank", "8"] if a.lora else [])]
    torchrun = os.path.join(os.path.dirname(py), "torchrun")
    run_session([torchrun, "--nproc-per-node", "1", "-m", "mimo_sft", "finetune", *args], cwd=ROOT, env=env,
                log=os.path.join(work, "finetune.log"))
    ckpt = os.path.join(work, "run", "checkpoints")
    before = _archive(a.before, work)
    print("| export | dtype | safetensors files | peak extra RSS MB | of it anonymous (RssAnon) MB | s |")
    print("|---|---|---|---|---|---|")
    what = "LoRA merged, " if a.lora else ""
    old_shards = "200MB" if a.lora else "-"  # the LoRA 'before' (b8ace25) already wrote shards
    rows = [(f"{what}whole model in host memory (before, {a.before})", before, "fp32", old_shards),
            (f"{what}whole model in host memory (before, {a.before})", before, "bf16", old_shards),
            (f"{what}streamed, 200MB shards", ROOT, "fp32", "200MB"), (f"{what}streamed, 200MB shards", ROOT, "bf16", "200MB"),
            (f"{what}streamed, 50MB shards", ROOT, "bf16", "50MB")]
    rows = [(*row, False) for row in rows]
    if a.lora:  # the PEFT folder: adapters and the trained tower (before: on the whole model)
        rows += [(f"LoRA --adapter-only, whole model in host memory (before, {a.before})", before, "fp32", "-", True),
                 ("LoRA --adapter-only, the checkpoint's tensors on a meta-device model", ROOT, "fp32", "-", True)]
    for i, (label, tree, dtype, shard, adapter_only) in enumerate(rows):
        out = os.path.join(work, f"hf_{i}")
        code = EXPORT_WORKER.format(tree=tree, scripts=os.path.join(ROOT, "scripts"), ckpt=ckpt, out=out, label=label,
                                    dtype=dtype, shard=shard, adapter_only=adapter_only)
        log = os.path.join(work, f"export_{i}.log")
        run_session([py, "-c", code], cwd=work, env=env, log=log)
        print("\n".join(ln for ln in open(log).read().splitlines() if ln.startswith(f"| {label} |")), flush=True)


def gil_suite(tensor_mb: int = 256, files: int = 4) -> int:
    """Whether the background writer thread takes the GIL from a Python-bound training loop (a GPU
    step is launch-bound: the Python thread issuing kernels is the step). A loop of small tensor ops
    on the main thread, timed in chunks of 500, alone and while a thread at the writer's niceness writes
    ``files`` tensors of ``tensor_mb`` MB the way megatron's writer does (``torch.save`` into the open
    file, then ``fsync``)."""
    import torch

    from mimo_sft.train.checkpoint.write import _lower_priority

    torch.set_num_threads(1)
    big = torch.randn(tensor_mb * 2 ** 20 // 4)
    folder = tempfile.mkdtemp(prefix="bench_checkpoint_gil_")

    def chunk() -> float:
        x, t0 = torch.randn(64, 64), time.perf_counter()
        for _ in range(500):
            x = (x @ x).tanh()
        return time.perf_counter() - t0

    def writer() -> None:
        _lower_priority()
        for i in range(files):
            with open(os.path.join(folder, f"{i}.pt"), "wb") as fh:
                torch.save(big, fh)
                os.fsync(fh.fileno())

    alone = [chunk() for _ in range(20)]
    thread = threading.Thread(target=writer)
    t0 = time.perf_counter()
    thread.start()
    during = []
    while thread.is_alive():
        during.append(chunk())
    wrote = time.perf_counter() - t0
    shutil.rmtree(folder, ignore_errors=True)
    a, b = statistics.median(alone), statistics.median(during)
    print("| loop of 500 small ops | chunks | median s | ratio |")
    print("|---|---|---|---|")
    print(f"| alone | {len(alone)} | {a:.4f} | 1.00 |")
    print(f"| while a writer thread saves {files} x {tensor_mb} MB ({wrote:.1f} s) | {len(during)} | {b:.4f} | {b / a:.2f} |")
    return 0


def _print_table(gathered, label: str) -> None:
    mb = 2 ** 20
    print("| code | save | rank | rank's own state MB | peak extra RSS MB | extra RSS when the call returned MB "
          "| writer peak USS MB | blocked s | until published s | load: peak extra RSS MB | load s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rank, own, rows, _normal in sorted(gathered):
        for name, extra, staged, child, blocked, total, _during, load_extra, load_s in rows:
            print(f"| {label} | {name} | {rank} | {own / mb:.0f} | {extra / mb:.0f} | {staged / mb:.0f} | {child / mb:.0f} "
                  f"| {blocked:.2f} | {total:.2f} | {load_extra / mb:.0f} | {load_s:.2f} |")
    print()
    print("| rank | training step s, no save (median) | training step s, async save in flight (median) | ratio |")
    print("|---|---|---|---|")
    for rank, _own, rows, normal in sorted(gathered):
        during = rows[-1][6]
        a = statistics.median(t for t, *_ in normal)
        b = statistics.median(t for t, *_ in during) if during else float("nan")
        print(f"| {rank} | {a:.2f} | {b:.2f} ({len(during)} steps) | {b / a:.2f} |")
    print()
    print("| rank | step | async save in flight | wall s | CPU s of the training thread | its wait for a CPU s "
          "| its minor page faults |")
    print("|---|---|---|---|---|---|---|")
    for rank, _own, rows, normal in sorted(gathered):
        for i, (t, faults, cpu, queued) in enumerate(rows[-1][6]):
            print(f"| {rank} | {i + 1} after the save started | yes | {t:.2f} | {cpu:.2f} | {queued:.2f} | {faults:,} |")
        for i, (t, faults, cpu, queued) in enumerate(normal):
            print(f"| {rank} | {i + 1} after it was published | no | {t:.2f} | {cpu:.2f} | {queued:.2f} | {faults:,} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text-hidden", type=int, default=1024)
    p.add_argument("--text-layers", type=int, default=12)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--suite", choices=("save", "load", "export", "gil"), default="save")
    p.add_argument("--async-only", action="store_true", help="--suite save: only the --async-save row and the step times")
    p.add_argument("--lora", action="store_true", help="--suite export: a LoRA run (--lora-rank 8, the vision tower "
                   "training), exported merged; measure 'before' with --before b8ace25 (the whole-model merge)")
    p.add_argument("--before", default="9b562d4", help="--suite export/load: the git revision measured as 'before'")
    p.add_argument("--save-before", help="--suite save: also measure this git revision's code ('before' rows)")
    p.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.add_argument("--load-worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker is not None:
        out_dir, *args = a.worker
        return worker(args, out_dir)
    if a.load_worker is not None:
        mode, *args = a.load_worker
        return load_worker(args, mode)
    if a.suite == "gil":
        return gil_suite()
    py, env = sys.executable, bench_env()
    if a.async_only:
        env["BENCH_ASYNC_ONLY"] = "1"
    work = tempfile.mkdtemp(prefix="bench_checkpoint_")
    model, data = os.path.join(work, "model"), os.path.join(work, "data")
    vision = ["--vision-hidden", "1280", "--vision-heads", "16", "--vision-depth", "8"] if a.suite == "load" else []
    subprocess.run([py, "scripts/make_tiny_qwen_vl.py", model, "--text-hidden", str(a.text_hidden), "--heads", "16",
                    "--kv-heads", "8", "--text-layers", str(a.text_layers), "--intermediate", str(4 * a.text_hidden),
                    *vision],
                   check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    subprocess.run([py, "scripts/make_demo_data.py", data], check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    if a.suite == "load":
        load_suite(a, py, env, work, model, data)
        return 0
    if a.suite == "export":
        export_suite(a, py, env, work, model, data)
        return 0
    n = a.nproc
    args = ["--hf-model", model, "--dataset-path", data, "--seq-length", str(a.seq_length), "--micro-batch-size", str(n),
            "--global-batch-size", str(n), "--train-iters", "100", "--use-distributed-optimizer", "--no-tensorboard",
            "--component", f"language=dp={n}", "--component", f"images=dp={n}", "--output-dir", os.path.join(work, "run")]
    torchrun = os.path.join(os.path.dirname(py), "torchrun")
    trees = ([(f"before ({a.save_before})", _archive(a.save_before, work))] if a.save_before else []) + [("now", ROOT)]
    for label, tree in trees:
        log = os.path.join(work, f"bench_{os.path.basename(tree)}.log")
        run_session([torchrun, "--nproc-per-node", str(n), "scripts/bench_checkpoint.py", "--worker",
                     os.path.join(work, "saves"), *args], cwd=ROOT, env=dict(env, BENCH_MIMO_TREE=tree, BENCH_LABEL=label),
                    log=log)
        text = open(log).read()
        print(text[text.index("| code |"):] if "| code |" in text else text[-3000:])
        for written in ("saves", "run"):  # gigabytes of checkpoints per run; the model and the log stay
            shutil.rmtree(os.path.join(work, written), ignore_errors=True)
    print(f"(model: {model}; logs: {work}/bench_*.log)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
