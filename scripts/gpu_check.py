"""The GPU check's stages (``bash scripts/gpu_check.sh`` runs this; see its header and docs/install.md).

Standard library only: it runs on the GPU machine's own interpreter before anything is installed, and starts
every other step as a child process with ``PYTHONPATH=SITE:ROOT`` (SITE: where the brought wheels were
installed with ``pip install --no-index --no-deps --target``).

Each stage stands alone (a failure is recorded and the next one runs; a stage that needs another's run makes
its own when that run is missing) and has its own time limit, cut to what is left of one budget; a stage
that no longer fits is recorded as skipped. Each records ok, failed (with its last error line), timed out
(never a pass) or skipped. Every training run is ``--no-save``, bf16, packed, on one rank, random init; its
loss must fall. What comes back, in OUT: ``log.txt`` (written by gpu_check.sh: everything, unfiltered),
``summary.json``, ``kernels.txt`` (one profiled step), ``runs.tgz`` (every run's metrics, config and result).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check_report as report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("qwen2_5_vl", "qwen3_5", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe")
#: stages in the order they run: most important first, so that a short budget keeps those; the profile comes
#: right after the families because it reads the headline run's trace (seconds, where a run of its own costs
#: a model's start-up)
STAGES = (*(f"family:{f}" for f in FAMILIES), "profile", "hf", "varlen", "fla", "memory", "check-model")
#: the headline model (transformers' peer and the profile run on it) and the memory stage's model
HEADLINE, MEMORY_MODEL = "qwen2_5_vl", "qwen3_vl"
#: largest relative loss difference per step between fla's Gated DeltaNet and the torch one (bf16 kernels
#: that sum in another order), and between two runs of the same kernels (deterministic on one device)
FLA_LOSS_RTOL, SAME_PATH_LOSS_RTOL = 5e-2, 1e-6

MODES = {
    # one H200: the models of gpu_check_inputs.MODELS["gpu"]; pages of 0.3-0.8 Mpx kept whole
    "gpu": dict(budget=480, min_start=30, seq=4096, mbs=2, big_mbs=8, lr=1e-5, warmup=3, steps=10,
                headline_steps=20, profile_step=12, memory_steps=4, threads="8",
                extra=["--max-pixels", "1003520", "--gpu-memory-gb", "1000"],
                limits={"install": 90, "inputs": 120, "family:qwen2_5_vl": 220, "family": 150, "hf": 150,
                        "varlen": 90, "fla": 200, "profile": 120, "memory": 180, "check-model": 120}),
    # the CPU stand-in: tiny models, short rows, a rate at which the loss falls in six steps
    "rehearse": dict(budget=540, min_start=10, seq=512, mbs=2, big_mbs=8, lr=2e-3, warmup=2, steps=6,
                     headline_steps=6, profile_step=4, memory_steps=3, threads="1",
                     extra=["--gpu-memory-gb", "1000"],
                     limits=collections.defaultdict(lambda: 150)),
}


class StageFailed(Exception):
    """A stage failed; the message is the line that says why (a command's last error line), ``details`` what
    the stage had measured by then (kept in its record)."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}


class StageTimedOut(Exception):
    """A stage ran past its limit."""


def wheel_list(kind: str = "") -> list[tuple[str, str]]:
    """(requirement, module) of scripts/gpu_wheels.txt's lines of ``kind`` ("" or "fla")."""
    out = []
    with open(os.path.join(ROOT, "scripts", "gpu_wheels.txt")) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if words and (words[0] == "fla") == (kind == "fla"):
                out.append(tuple(words[-2:]))
    return out


def last_error_line(lines) -> str:
    """The last line that reads as an error (warnings aside), else the last non-empty line."""
    lines = [ln.strip() for ln in lines if ln.strip()]
    for ln in reversed(lines):
        low = ln.lower()
        if "warn" not in low and any(w in low for w in ("error", "exception", "traceback", "refus", "failed",
                                                        "killed", "out of memory", "cannot", "no such")):
            return ln[:500]
    return lines[-1][:500] if lines else "(no output)"


def _children_cpu() -> float:
    """CPU seconds (user + system) of every finished child so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


class Check:
    """One run of the check: paths, the budget, the stages' records."""

    def __init__(self, a):
        self.mode, self.m = a.mode, MODES[a.mode]
        self.out, self.py = os.path.abspath(a.out), a.python
        self.work = os.path.abspath(a.work or tempfile.mkdtemp(prefix="gpu-check-"))
        self.site, self.fla_whl = os.path.join(self.work, "site"), os.path.abspath(a.fla)
        self.whl = a.whl if a.whl == "none" else os.path.abspath(a.whl)
        self.budget = float(a.budget or self.m["budget"])
        self.only = set(a.stages.split(",")) if a.stages else None
        self.t0 = time.monotonic()
        self.deadline = None
        self.records: list[dict] = []
        self.runs: dict[str, tuple] = {}  # run name -> (figures, result)
        self.environment: dict = {}
        os.makedirs(self.out, exist_ok=True)
        for d in ("runs", "results", "models"):
            os.makedirs(os.path.join(self.work, d), exist_ok=True)

    # ---- processes --------------------------------------------------------------------------------------
    def env(self, extra_path: str | None = None) -> dict:
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONUNBUFFERED="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        env.setdefault("OMP_NUM_THREADS", self.m["threads"])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, self.site, ROOT) if p)
        return env

    def log(self, text: str) -> None:
        print(f"[gpu_check {time.monotonic() - self.t0:5.0f}s] {text}", flush=True)

    def run_many(self, cmds: list[list[str]], env: dict | None = None) -> list[tuple[int, list[str]]]:
        """Run ``cmds`` at once, each in its own session, their output streamed here; kill them all at the
        stage's deadline (StageTimedOut). Returns (status, last lines) per command."""
        procs, tails, readers = [], [], []
        for cmd in cmds:
            self.log("$ " + " ".join(cmd))
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                 env=env or self.env(), cwd=ROOT, start_new_session=True)
            tail: collections.deque = collections.deque(maxlen=300)
            t = threading.Thread(target=self._pump, args=(p, tail), daemon=True)
            t.start()
            procs.append(p), tails.append(tail), readers.append(t)
        try:
            for p in procs:
                p.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                self._kill(p)
            raise StageTimedOut(f"killed at the stage's limit: {' '.join(cmds[0])[:200]}") from None
        for t in readers:
            t.join(5)
        return [(p.returncode, list(tail)) for p, tail in zip(procs, tails)]

    @staticmethod
    def _pump(p, tail) -> None:
        for line in p.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line)

    @staticmethod
    def _kill(p) -> None:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(p.pid, sig)
                p.wait(timeout=wait)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue

    def run(self, cmd: list[str], env: dict | None = None, check: bool = True) -> tuple[int, list[str]]:
        rc, tail = self.run_many([cmd], env)[0]
        if check and rc != 0:
            raise StageFailed(last_error_line(tail))
        return rc, tail

    # ---- stages -----------------------------------------------------------------------------------------
    def stage(self, name: str, fn) -> None:
        """Run one stage inside its limit and the budget; record its outcome."""
        rec = {"stage": name}
        left = self.budget - (time.monotonic() - self.t0)
        limit = min(self.m["limits"].get(name, self.m["limits"].get(name.split(":")[0], 150)), left)
        if self.only is not None and name not in self.only and name not in ("install", "inputs"):
            self.records.append(dict(rec, status="skipped", reason="not in GPU_CHECK_STAGES"))
            return
        if left < self.m["min_start"]:
            self.records.append(dict(rec, status="skipped", reason=f"{left:.0f} s of the {self.budget:.0f} s budget left"))
            self.log(f"SKIP {name}: over budget")
            return
        self.deadline = time.monotonic() + limit
        self.log(f"START {name} (limit {limit:.0f} s)")
        t, cpu = time.monotonic(), _children_cpu()
        try:
            rec.update(status="ok", **(fn() or {}))
        except StageFailed as e:
            rec.update(status="failed", error=str(e), **e.details)
        except StageTimedOut as e:
            rec.update(status="timed out", error=str(e))
        except Exception as e:  # this script's own mistake: recorded, and the next stage still runs
            rec.update(status="failed", error=f"gpu_check.py: {type(e).__name__}: {e}")
        rec.update(seconds=round(time.monotonic() - t, 1), cpu_s=round(_children_cpu() - cpu, 1), limit_s=round(limit))
        self.log(f"END {name}: {rec['status']}" + (f" -- {rec['error']}" if "error" in rec else ""))
        self.records.append(rec)

    def flags(self, model: str, run: str, *, mbs: int, steps: int, profile: int | None = None) -> list[str]:
        m = self.m
        out = ["--hf-model", os.path.join(self.work, "models", model), "--dataset-path",
               os.path.join(self.work, "data.parquet"), "--dtype", "bf16", "--use-distributed-optimizer",
               "--seq-length", str(m["seq"]), "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs),
               "--train-iters", str(steps), "--lr", str(m["lr"]), "--lr-warmup-iters", "0", "--lr-decay-style",
               "constant", "--dataloader-type", "single", "--component", "language=dp=1", "--component",
               "images=dp=1", "--in-batch-packing", "--allow-random-init", "--no-save", "--log-interval", "1",
               "--no-tensorboard", "--output-dir", os.path.join(self.work, "runs", run), *m["extra"]]
        return out + (["--profile-steps", str(profile)] if profile else [])

    def train(self, run: str, model: str, *, mbs: int | None = None, steps: int | None = None,
              profile: int | None = None, env: dict | None = None) -> dict:
        """One finetune run through gpu_check_run.py; its figures. Fails unless it logged every step and its
        loss fell."""
        mbs, steps = mbs or self.m["mbs"], steps or self.m["steps"]
        result_path = os.path.join(self.work, "results", f"{run}.json")
        rc, tail = self.run([self.py, os.path.join(ROOT, "scripts", "gpu_check_run.py"), result_path, "--",
                             *self.flags(model, run, mbs=mbs, steps=steps, profile=profile)], env=env, check=False)
        result = json.load(open(result_path)) if os.path.isfile(result_path) else None
        figures = report.run_figures(os.path.join(self.work, "runs", run), self.m["warmup"])
        self.runs[run] = (figures, result)
        rec = {"run": run, "model": model, "micro_batch": mbs, "gdn_kernels": (result or {}).get("gdn_kernels"),
               "figures": figures, "memory": report.memory_row(run, figures, result)}
        if rc != 0:
            raise StageFailed(last_error_line(tail), rec)
        if figures is None or figures["steps"] != steps:
            raise StageFailed(f"{run}: logged {figures['steps'] if figures else 0} of {steps} steps", rec)
        if not figures["loss_fell"]:
            raise StageFailed(f"{run}: the loss did not fall ({figures['losses'][0]:.4f} -> "
                              f"{figures['losses'][-1]:.4f})", rec)
        return rec

    def family(self, name: str) -> dict:
        headline = name == HEADLINE
        return self.train(f"family-{name}", name, steps=self.m["headline_steps"] if headline else None,
                          profile=self.m["profile_step"] if headline else None)

    def finish(self) -> int:
        """summary.json and runs.tgz into OUT; a table of the stages; 0 when every stage is ok."""
        ok = bool(self.records) and all(r["status"] == "ok" for r in self.records)
        summary = {"mode": self.mode, "ok": ok, "budget_s": self.budget,
                   "elapsed_s": round(time.monotonic() - self.t0, 1), "cpu_s": round(_children_cpu(), 1),
                   "environment": self.environment,
                   "stages": self.records}
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with tarfile.open(os.path.join(self.out, "runs.tgz"), "w:gz") as tar:
            for path in sorted(glob.glob(os.path.join(self.work, "runs", "*", "*.*")) +
                               glob.glob(os.path.join(self.work, "results", "*.json"))):
                if not path.endswith(".trace.json"):
                    tar.add(path, arcname=os.path.relpath(path, self.work))
        self.log(f"done in {summary['elapsed_s']:.0f} s; {'every stage ok' if ok else 'NOT every stage ok'}")
        for r in self.records:
            print(f"  {r['stage']:<22} {r['status']:<10} {r.get('seconds', 0):6.0f} s {r.get('cpu_s', 0):6.0f} s CPU  "
                  f"{r.get('error') or r.get('reason') or r.get('note') or ''}")
        return 0 if ok else 1


def main(argv=None) -> int:
    import gpu_check_stages as st

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=sorted(MODES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--python", default=sys.executable, help="the interpreter every step runs with")
    p.add_argument("--whl", default=os.path.join(ROOT, ".whl"),
                   help="folder of the wheels to install; 'none': the interpreter already has every package")
    p.add_argument("--fla", default=os.path.join(ROOT, ".whl-fla"))
    p.add_argument("--work", default=None, help="scratch folder (default: a new temporary one, removed at the end)")
    p.add_argument("--budget", type=float, default=None, help="seconds for all stages")
    p.add_argument("--stages", default=None, help="comma-separated stage names to run (install and inputs always run)")
    a = p.parse_args(argv)
    unknown = set((a.stages or "").split(",")) - set(STAGES) - {""}
    if unknown:
        print(f"gpu_check: unknown stage(s) {', '.join(sorted(unknown))}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    c = Check(a)
    c.log(f"mode {c.mode}, budget {c.budget:.0f} s, out {c.out}, work {c.work}")
    c.stage("install", lambda: st.install(c))
    c.stage("inputs", lambda: st.inputs(c))
    for f in FAMILIES:
        c.stage(f"family:{f}", lambda f=f: c.family(f))
    for name in STAGES[len(FAMILIES):]:
        c.stage(name, lambda fn=getattr(st, name.replace("-", "_")): fn(c))
    rc = c.finish()
    if a.work is None:
        shutil.rmtree(c.work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    # gpu_check_stages imports this module by name: one module object, so that its StageFailed is this one
    sys.modules["gpu_check"] = sys.modules["__main__"]
    sys.exit(main())
