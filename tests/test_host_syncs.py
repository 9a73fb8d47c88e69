"""Host syncs per training step, counted on the CPU.

On a GPU, reading a device tensor's value on the host (``.item()``, ``.tolist()``, ``.cpu()``,
``bool(t)``, ``float(t)``, formatting it, ``torch.cuda.synchronize``) waits for every kernel queued
before it: inside the overlapped backward such a wait stalls the reductions the overlap hides. The
CPU has no such waits, so :class:`SyncCounter` counts the calls that WOULD wait: it wraps those
methods on ``torch.Tensor`` while one training step runs on the training thread, and records each
call by its call site (the first frame outside torch). Reads of tensors that a GPU run keeps on the
host are counted apart (:data:`HOST_SITES`).

The run: 4 in-process gloo ranks (``dist_utils.run_distributed``), non-colocated language dp 2 +
images dp 2, overlapped reduction, the tiny Qwen2.5-VL on the demo data; ``Trainer.train_step`` (the
schedule, the gradient finalize, the optimizer step) is counted, step by step, on every rank.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import pytest
import torch

from dist_utils import run_distributed
from train_helpers import demo_data, new_dir, tiny_model

#: the methods whose call reads a tensor's value on the host (a device sync on a GPU)
_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep
_SHIMS = os.path.join("mimo_sft", "parallel", "cpu_shims.py")


def _skipped(path: str) -> bool:
    """Frames a call is not attributed to: torch's own (except its optimizers), the CPU shims'
    wrappers around megatron's factories, and this file."""
    return ((path.startswith(_TORCH_DIR) and not path.startswith(_OPTIM_DIR)) or path.endswith(_SHIMS)
            or path == __file__)


def _call_site() -> str:
    """``path:line function`` of the first frame that :func:`_skipped` keeps."""
    frame = sys._getframe(2)
    while frame is not None and _skipped(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for marker in ("site-packages" + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


class SyncCounter:
    """Counts host reads of tensor values on the thread that enters it (see the module docstring)."""

    def __init__(self):
        self.sites = collections.Counter()
        self._thread = None
        self._depth = threading.local()
        self._saved = {}

    def _wrap(self, name, original):
        counter = self

        def wrapper(*args, **kwargs):
            inner = getattr(counter._depth, "n", 0)
            if inner == 0 and threading.get_ident() == counter._thread:
                counter.sites[f"{name}  {_call_site()}"] += 1
            counter._depth.n = inner + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._depth.n = inner

        return wrapper

    def __enter__(self):
        self._thread = threading.get_ident()
        for name in _METHODS:
            self._saved[(torch.Tensor, name)] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        from mimo_sft.parallel import cpu_shims

        for owner, name in ((torch.cuda, "synchronize"), (cpu_shims._NullStream, "synchronize")):
            self._saved[(owner, name)] = owner.__dict__.get(name)
            setattr(owner, name, self._wrap("synchronize", getattr(owner, name)))
        return self

    def __exit__(self, *exc):
        for (owner, name), original in self._saved.items():
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        return False

    @property
    def total(self) -> int:
        return sum(self.sites.values())


#: call sites whose tensors a GPU run holds on the host (no device sync there), or that only the CPU
#: runs (megatron's fallbacks without Transformer Engine or apex, torch's Adam); each with the reason.
#: Every other site counts as a device sync: a new host read lands here only with its reason.
HOST_SITES = {
    "mimo_sft/train/feed.py": "the micro-batch before runtime.to_device",
    "mimo_sft/data/": "the data pipeline's host tensors",
    "mimo_sft/train/metrics.py": "FLOPs counted from the host micro-batch",
    "mimo_sft/train/packing.py": "packing reads the host rows; cu_seqlens stay on the host",
    "mimo_sft/model/segments.py": "segments of a host cu_seqlens",
    "mimo_sft/model/vision_attention.py": "the tower's plan from the host image_grid_thw",
    "mimo_sft/model/pixels.py": "each item's kind (image or clip) from the host image_grid_thw",
    "transformers/vision_utils.py": "called by vision_attention on the host image_grid_thw",
    "megatron/core/models/common/embeddings/rope_utils.py:_apply_rotary_pos_emb_thd": "host cu_seqlens (packing)",
    "mimo_sft/train/step.py:global_tokens": "a float64 host tensor reduced over gloo",
    "torch/optim/": "torch's Adam on the CPU (its step count); GPU runs use Transformer Engine's FusedAdam",
    "megatron/core/utils.py:local_multi_tensor_l2_norm": "megatron's norm without Transformer Engine or apex",
    "megatron/core/optimizer/clip_grads.py:get_grad_norm_fp32":
        "the norm's .item() megatron skips where Transformer Engine's multi_tensor_scale_tensor exists",
}


def _host_reason(site: str):
    path_line, function = site.split("  ", 1)[1].split(" ", 1)
    path = path_line.rsplit(":", 1)[0]
    for key, reason in HOST_SITES.items():
        where, _, fn = key.partition(":")
        if path.startswith(where) and (not fn or fn == function):
            return reason
    return None


def device_syncs(sites: dict) -> dict:
    """The sites of ``sites`` that would be device syncs on a GPU, with their counts."""
    return {site: n for site, n in sites.items() if _host_reason(site) is None}


#: device syncs per training step on each rank of the layout below (docs/benchmarks.md, "Host syncs per
#: step"), whatever the number of buckets
BUDGET = {"language": 10, "images": 7}


def _flags(out: str, bucket_size: int, steps: int) -> list[str]:
    return ["--hf-model", tiny_model(), "--dataset-path", demo_data(), "--output-dir", out,
             "--component", "language=dp=2", "--component", "images=dp=2,rank_offset=2", "--scalable-dp",
             "--seq-length", "192", "--micro-batch-size", "4", "--global-batch-size", "8",
             "--train-iters", str(steps + 1), "--lr", "1e-3", "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
             "--no-tensorboard", "--dataloader-type", "cyclic", "--seed", "7", "--no-save",
             "--ddp-bucket-size", str(bucket_size)]


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
    """One rank: build the run as ``finetune`` does, count each ``train_step``'s host reads, then
    (``poison``) one step with non-finite gradients."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.train.trainer import Trainer
    from mimo_sft.validate import require_valid

    cfg = load_config(flags)
    layout = require_valid(cfg, world_size=world).layout
    trainer = Trainer(cfg, layout)
    trainer.setup()
    per_step = []
    try:
        for _ in range(steps):
            with SyncCounter() as counter:
                result = trainer.train_step()
            trainer.log_step(result)
            per_step.append(dict(counter.sites))
        buckets = {name: sum(len(g.buckets) for g in m.bucket_groups) for name, m in trainer.ctx.modules.items()}
        refused = _non_finite_step(trainer, rank) if poison else None
    finally:
        trainer.close()
    return {"steps": per_step, "buckets": buckets, "refused": refused}


def _run(name: str, bucket_size, steps: int = 3, poison: bool = False):
    return run_distributed(count_steps, 4, _flags(new_dir(name), bucket_size, steps), steps, poison, timeout=400)


def _report(ranks) -> str:
    lines = []
    for rank, r in enumerate(ranks):
        lines.append(f"rank {rank} buckets {r['buckets']} device syncs per step "
                     f"{[sum(device_syncs(s).values()) for s in r['steps']]}, host reads "
                     f"{[sum(s.values()) - sum(device_syncs(s).values()) for s in r['steps']]}")
        for site, n in sorted(r["steps"][-1].items()):
            lines.append(f"    {n:4d}  {'host' if _host_reason(site) else 'SYNC'}  {site}")
    return "\n".join(lines)


def _bridge_transfer_site(site: str) -> bool:
    """A sync inside one of the bridge communicator's transfers (its shape exchange is another method)."""
    return "bridge_communicator.py" in site and site.rsplit(" ", 1)[1].startswith(("send_", "recv_"))


@pytest.mark.e2e
def test_device_syncs_per_step_do_not_grow_with_buckets_and_a_nan_stops_every_rank():
    """Two bucket sizes (the language model's and the vision tower's buckets both change): every rank
    syncs as often in every step, within the budget; megatron's per-bucket NaN check and the bridge's
    debug strings are gone. Then a step whose reduced gradients hold a NaN (images, rank 2) and an inf
    (language, rank 1) is refused on every rank, naming both modules, with no weight changed."""
    big = _run("syncs_big", 8000, poison=True)
    small = _run("syncs_small", 2000)
    print("--ddp-bucket-size 8000\n" + _report(big) + "\n--ddp-bucket-size 2000\n" + _report(small))
    for rank, (a, b) in enumerate(zip(big, small)):
        (module,) = a["buckets"]
        assert 1 < a["buckets"][module] < b["buckets"][module], (rank, a["buckets"], b["buckets"])
        for step, (sa, sb) in enumerate(zip(a["steps"], b["steps"]), start=1):
            da, db = device_syncs(sa), device_syncs(sb)
            assert da == db, (rank, step, _report([a]), _report([b]))
            assert sum(da.values()) <= BUDGET[module], (rank, step, _report([a]))
            assert not [s for s in da if "rerun_state_machine" in s or _bridge_transfer_site(s)], da
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
    t = torch.arange(6.0).reshape(2, 3)
    with SyncCounter() as unpatched:
        want = module.Sender().send(t)
    assert unpatched.total == 2  # the reference: both f-strings format a 0-dim sum (.item())
    assert guard_debug_logging(module) == ["Sender.send", "Sender.fail"]
    assert guard_debug_logging(module) == ["Sender.send", "Sender.fail"]  # idempotent
    caplog.set_level(logging.WARNING, logger="")
    with SyncCounter() as off:
        got = module.Sender().send(t)
    assert torch.equal(got, want) and off.total == 0 and not caplog.records
    caplog.set_level(logging.DEBUG, logger="")
    with SyncCounter() as on:
        module.Sender().send(t)
    assert on.total == 2
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
