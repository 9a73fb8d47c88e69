"""Host reads per training step, counted on the CPU with the device audit's stand-in device.

On a GPU, reading a device tensor's value on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``,
``nonzero``, ``torch.equal``, boolean-mask indexing, ``torch.tensor`` of device scalars,
``torch.cuda.synchronize``) waits for every kernel queued before it: inside the overlapped backward such a wait
stalls the reductions the overlap hides. The CPU has no such waits, so each rank runs on the stand-in device of
``mimo_sft.testing.device_audit``: its tensors keep host bytes (the run trains exactly as on the CPU) while every
read of a would-be device value is recorded with its call site. Host tensors (the data pipeline's, packing's
bounds, the gloo collectives' counters) are host tensors there too, so nothing is exempted by name: megatron's
per-tensor gradient norm, torch's Adam, the loss's ``.tolist()`` and the MIMO alignment's ``nonzero`` and
``.item()`` are all counted.

The run: 4 in-process gloo ranks (``dist_utils.run_distributed``), non-colocated language dp 2 + images dp 2,
overlapped reduction, the tiny Qwen2.5-VL on the demo data; ``Trainer.train_step`` (the schedule, the gradient
finalize, the optimizer step) and ``log_step`` (metrics) are counted, step by step, on every rank.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from train_helpers import demo_data, new_dir, tiny_model

#: host reads per training step (docs/benchmarks.md, "Host reads per step"), whatever the number of buckets:
#: the grad norm's slot list on every rank; the buffered losses once per log interval, on the language ranks
BUDGET = {"step": 1, "log step": 1}
LOG_INTERVAL = 2


def _flags(out: str, bucket_size: int, steps: int) -> list[str]:
    return ["--hf-model", tiny_model(), "--dataset-path", demo_data(), "--output-dir", out,
             "--component", "language=dp=2", "--component", "images=dp=2,rank_offset=2", "--scalable-dp",
             "--seq-length", "192", "--micro-batch-size", "4", "--global-batch-size", "8",
             "--train-iters", str(steps + 1), "--lr", "1e-3", "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
             "--no-tensorboard", "--dataloader-type", "cyclic", "--seed", "7", "--no-save",
             "--ddp-bucket-size", str(bucket_size), "--log-interval", str(LOG_INTERVAL)]


def _snapshot(modules) -> list:
    return [p.detach().clone() for m in modules.values() for p in m.parameters()]


def _non_finite_step(trainer, rank: int) -> str:
    """One more step, with a NaN put into the reduced vision gradient on rank 2 and an inf into the
    language one on rank 1 (after the DP reduction: on that rank only): what each rank raises, and
    whether any weight changed."""
    from mimo_sft.errors import UserError

    ctx = trainer.ctx
    ctx.optimizer.zero_grad()
    trainer.runner.run(trainer.num_microbatches)
    poison = {2: ("images", float("nan")), 1: ("language", float("inf"))}.get(rank)
    if poison is not None:  # into this rank's own shard of the distributed optimizer's first bucket
        ddp = ctx.modules[poison[0]]
        bucket, dp = ddp.buffers[0].buckets[0], ddp.intra_dp_cp_group
        bucket.grad_data[dp.rank() * (bucket.grad_data.numel() // dp.size())] = poison[1]
    before = _snapshot(ctx.modules)
    try:
        ctx.optimizer.step()
        message = None
    except UserError as err:
        message = str(err)
    changed = any(not torch.equal(a, b) for a, b in zip(before, _snapshot(ctx.modules)))
    return message, changed


def count_steps(rank: int, world: int, flags: list, steps: int, poison: bool) -> dict:
    """One rank on the stand-in device: build the run as ``finetune`` does, record each ``train_step``'s and
    ``log_step``'s host reads (and any op mixing a host array into device work), then (``poison``) one step
    with non-finite gradients."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.testing.device_audit import DeviceAudit
    from mimo_sft.train.trainer import Trainer
    from mimo_sft.validate import require_valid

    cfg = load_config(flags)
    layout = require_valid(cfg, world_size=world).layout
    per_step, mixed = [], []
    with DeviceAudit() as audit:
        trainer = Trainer(cfg, layout)
        trainer.setup()
        try:
            mixed += audit.log.take().mixed()
            for _ in range(steps):
                result = trainer.train_step()
                stepped = audit.log.take()
                trainer.log_step(result)
                logged = audit.log.take()
                per_step.append({"step": stepped.count_by("read", "op+site"), "log": logged.count_by("read", "op+site")})
                mixed += stepped.mixed() + logged.mixed()
            buckets = {name: sum(len(g.buckets) for g in m.bucket_groups) for name, m in trainer.ctx.modules.items()}
            refused = _non_finite_step(trainer, rank) if poison else None
        finally:
            trainer.close()
    return {"steps": per_step, "buckets": buckets, "refused": refused,
            "mixed": sorted({f"{f.op}  {f.site}" for f in mixed})}


count_steps.on_standin_device = True


def _run(name: str, bucket_size, steps: int = 3, poison: bool = False):
    return run_distributed(count_steps, 4, _flags(new_dir(name), bucket_size, steps), steps, poison, timeout=400)


def _report(ranks) -> str:
    lines = []
    for rank, r in enumerate(ranks):
        lines.append(f"rank {rank} buckets {r['buckets']} reads per step "
                     f"{[(sum(s['step'].values()), sum(s['log'].values())) for s in r['steps']]}")
        for part in ("step", "log"):
            for site, n in sorted(r["steps"][-1][part].items()):
                lines.append(f"    {n:4d}  {part:4s}  {site}")
    return "\n".join(lines)


@pytest.mark.e2e
def test_host_reads_per_step_do_not_grow_with_buckets_and_a_nan_stops_every_rank():
    """Two bucket sizes (the language model's and the vision tower's buckets both change): every rank reads
    as often in every step, within the budget -- the grad norm's slot list each step, the buffered losses on
    log steps -- and mixes no host array into device work. Then a step whose reduced gradients hold a NaN
    (images, rank 2) and an inf (language, rank 1) is refused on every rank, naming both modules, with no
    weight changed."""
    big = _run("syncs_big", 8000, poison=True)
    small = _run("syncs_small", 2000)
    print("--ddp-bucket-size 8000\n" + _report(big) + "\n--ddp-bucket-size 2000\n" + _report(small))
    for rank, (a, b) in enumerate(zip(big, small)):
        (module,) = a["buckets"]
        assert 1 < a["buckets"][module] < b["buckets"][module], (rank, a["buckets"], b["buckets"])
        assert not a["mixed"] and not b["mixed"], (rank, a["mixed"], b["mixed"])
        for step, (sa, sb) in enumerate(zip(a["steps"], b["steps"]), start=1):
            assert sa == sb, (rank, step, _report([a]), _report([b]))
            assert sum(sa["step"].values()) <= BUDGET["step"], (rank, step, _report([a]))
            log_step = step % LOG_INTERVAL == 0
            assert sum(sa["log"].values()) <= (BUDGET["log step"] if log_step and module == "language" else 0), (
                rank, step, _report([a]))
        assert any(sum(s["log"].values()) for s in a["steps"]) == (module == "language"), _report([a])
    for rank, r in enumerate(big):
        message, changed = r["refused"]
        assert message is not None and not changed, (rank, r["refused"])
        assert "images (NaN)" in message and "language (inf)" in message, message


_LOGGING_MODULE = '''
import logging

import torch


class Sender:
    def send(self, t):
        out = t * 2
        logging.debug(f"sent {t.shape} sum {t.sum()}")
        if out.numel():
            logging.debug(f"doubled sum {out.sum()}")
        return out

    def fail(self):
        logging.debug("about to fail")
        raise ValueError("here")
'''


def test_guarded_debug_strings_are_built_only_with_debug_logging_on(tmp_path, monkeypatch, caplog):
    """The recompiled methods do what megatron's do, read no tensor value with debug logging off, log
    the same messages with it on, and keep their file and line numbers."""
    import importlib
    import logging
    import traceback

    from mimo_sft.parallel.megatron_patches import guard_debug_logging

    (tmp_path / "sync_demo_sender.py").write_text(_LOGGING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("sync_demo_sender")
    line_of_raise = _LOGGING_MODULE.splitlines().index('        raise ValueError("here")') + 1
    from mimo_sft.testing.device_audit import STANDIN_DEVICE, DeviceAudit

    def reads(fn):  # host reads of a call given a device tensor
        with DeviceAudit() as audit:
            out = fn(torch.arange(6.0).reshape(2, 3).to(STANDIN_DEVICE))
            host = out.inner.clone()
        return host, len(audit.log.reads())

    want, unpatched = reads(module.Sender().send)
    assert unpatched == 2  # the reference: both f-strings format a 0-dim sum (.item())
    assert guard_debug_logging(module) == ["Sender.send", "Sender.fail"]
    assert guard_debug_logging(module) == ["Sender.send", "Sender.fail"]  # idempotent
    caplog.set_level(logging.WARNING, logger="")
    got, off = reads(module.Sender().send)
    assert torch.equal(got, want) and off == 0 and not caplog.records
    caplog.set_level(logging.DEBUG, logger="")
    assert reads(module.Sender().send)[1] == 2
    assert [r.getMessage() for r in caplog.records] == ["sent torch.Size([2, 3]) sum 15.0", "doubled sum 30.0"]
    with pytest.raises(ValueError) as err:
        module.Sender().fail()
    frame = traceback.extract_tb(err.value.__traceback__)[-1]
    assert (frame.filename, frame.lineno, frame.name) == (module.__file__, line_of_raise, "fail")


def test_megatron_bridge_transfers_are_guarded():
    """Every method of megatron's BridgeCommunicator that logs at debug level is replaced, from its own file."""
    import inspect

    from mimo_sft.parallel.megatron_patches import guard_bridge_debug_logging
    from megatron.core.pipeline_parallel import bridge_communicator as bc

    replaced = guard_bridge_debug_logging()
    transfers = {"send_forward", "recv_forward", "send_backward", "recv_backward", "send_forward_recv_backward",
                 "send_backward_recv_forward"}
    assert transfers <= {name.split(".")[1] for name in replaced}
    source = inspect.getsource(bc)
    for name in replaced:
        code = getattr(bc.BridgeCommunicator, name.split(".")[1]).__code__
        assert code.co_filename == inspect.getsourcefile(bc)
        assert source.splitlines()[code.co_firstlineno - 1].strip().startswith(f"def {name.split('.')[1]}(")
