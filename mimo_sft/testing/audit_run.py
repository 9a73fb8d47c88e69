"""A real training run on the stand-in device (``testing.device_audit``): what each step would put on a GPU
and read back from it, for every family.

One process, one rank, the colocated layout a single GPU runs (``language=dp=1``, ``images=dp=1``): the
trainer is built as ``finetune`` builds it (``train.trainer.Trainer``: megatron's MimoModel, DDP, MIMO
optimizer, the feed), with this process's device set to the stand-in before anything else, so every
parameter, gradient buffer, optimizer state and micro-batch tensor that a GPU run keeps on the GPU is a
stand-in tensor. Each step's forward, backward, gradient finalize and optimizer step (``train_step``) and
its metrics (``log_step``) run inside the audit; set-up is audited too but reported apart.

``python -m mimo_sft.testing.audit_run OUT.json SPEC.json`` writes :func:`audit_training`'s report of each run
SPEC names (tests and ``scripts/bench_step_ops.py`` run it in a subprocess: a process chooses its device once).
"""

from __future__ import annotations

import json
import sys

from mimo_sft.testing.device_audit import STANDIN_DEVICE, AuditLog, DeviceAudit


def _summary(log: AuditLog) -> dict:
    return {"reads": log.count_by("read", "op+site"), "mixed": log.count_by("mixed", "op+site"),
            "reads_by_phase": log.count_by("read", "phase"), "h2d_copies": log.h2d_copies,
            "ops_by_phase": dict(log.ops)}


def audit_training(flags: list[str], steps: int = 2, *, evaluate: bool = False, world_size: int = 1) -> dict:
    """``steps`` training steps of ``finetune FLAGS`` (one rank) under the audit: per step, what
    ``train_step`` and ``log_step`` read back and mixed, and the same for set-up; the losses, to show the
    run trained, and the vision items each step's micro-batches carried (``clips``: items with more than one
    frame row). ``evaluate``: one validation pass after the steps (its forwards run the tower too). ``world_size``:
    the ranks of a started world (every one calls this; tests' ``run_distributed`` on the stand-in device)."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.parallel import runtime
    from mimo_sft.train.trainer import Trainer
    from mimo_sft.validate import require_valid

    if not runtime.device_chosen():
        runtime.use_device(STANDIN_DEVICE)
    assert runtime.device() == STANDIN_DEVICE, runtime.device()
    report = {"steps": [], "logs": [], "losses": [], "items": []}
    with DeviceAudit() as audit:
        cfg = load_config(flags)
        trainer = Trainer(cfg, require_valid(cfg, world_size=world_size).layout)
        try:
            trainer.setup()
            report["setup"] = _summary(audit.log.take())
            report["param_tensors"] = sum(1 for m in trainer.ctx.modules.values() for p in m.parameters()
                                          if p.requires_grad)
            seen = _count_vision_items(trainer.runner)
            for _ in range(steps):
                result = trainer.train_step()
                report["steps"].append(_summary(audit.log.take()))
                trainer.log_step(result)
                report["logs"].append(_summary(audit.log.take()))
                loss_sum, tokens = result.output.sums.inner.tolist()  # the audit's own look (no read counted)
                report["losses"].append(loss_sum / max(tokens, 1.0))
                report["items"].append(dict(seen))
                seen.update(images=0, clips=0)
            if evaluate:
                assert trainer.evaluator is not None, "evaluate=True needs a validation set in the flags"
                report["valid_loss"] = trainer.evaluator.evaluate(trainer.step).valid_loss
                report["evaluation"] = _summary(audit.log.take())
        finally:
            trainer.close()
    return report


def _count_vision_items(runner) -> dict:
    """Images and clips of the micro-batches the runner takes from now on (its micro-batch hook, chained)."""
    seen = {"images": 0, "clips": 0}
    before = runner.micro_batch_hook

    def hook(batch):
        grid = batch.get("image_grid_thw")
        if grid is not None and grid.numel():
            clips = int((grid[:, 0] > 1).sum())
            seen["clips"] += clips
            seen["images"] += grid.shape[0] - clips
        if before is not None:
            before(batch)

    runner.micro_batch_hook = hook
    return seen


def main(argv: list[str]) -> int:
    """``OUT.json SPEC.json``: SPEC maps a run name to ``{"flags": [...], "steps": N, "evaluate": bool}``; the
    runs go one after another in this process, OUT maps each name to its report."""
    out, spec_path = argv
    with open(spec_path) as fh:
        spec = json.load(fh)
    reports = {}
    for name, run in spec.items():
        reports[name] = audit_training(run["flags"], run.get("steps", 2), evaluate=run.get("evaluate", False))
        with open(out, "w") as fh:  # what finished so far, should a later run fail
            json.dump(reports, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


_BACKWARD = ("language backward", "encoder backward")
_OPTIMIZER = ("gradient finalize", "optimizer")


def phase_group(phase: str) -> str:
    """"forward", "backward" or "optimizer" for a training-thread phase (``mimo_sft.progress``); what follows a
    phase ("compute after X") goes with it, except after the optimizer: that is the next step's start."""
    name = phase[len("compute after "):] if phase.startswith("compute after ") else phase
    if name in _OPTIMIZER and not (name == "optimizer" and phase != name):
        return "optimizer"
    return "backward" if name in _BACKWARD else "forward"


def by_group(per_phase: dict) -> dict:
    """``{"forward": n, "backward": n, "optimizer": n}`` from counts per phase name."""
    out = {"forward": 0, "backward": 0, "optimizer": 0}
    for phase, n in per_phase.items():
        out[phase_group(phase)] += n
    return out


def run_specs(spec: dict, out_json: str, *, timeout: float = 1200.0) -> dict:
    """Run :func:`main` on ``spec`` in a fresh process (its device is the stand-in); its reports."""
    import os
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "mimo_sft.testing.audit_run", out_json, fh.name], env=env,
                          capture_output=True, text=True, timeout=timeout)
    os.unlink(fh.name)
    if done.returncode != 0:
        raise RuntimeError(f"the audited runs failed:\n{done.stderr[-4000:]}")
    with open(out_json) as fh:
        return json.load(fh)
