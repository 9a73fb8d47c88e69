"""How a ``finetune`` or ``evaluate`` rank starts and fails: load and check the config on every rank (before
any process group exists, so a bad layout is refused on every rank with the same message), check how it was
launched (a multi-rank layout needs torchrun; one rank also runs without it), then run the body. A user
error on any rank is printed as one line and the rank exits with status 2; torchrun then stops the others,
so nothing hangs. A DataLoader worker that died is one line too (``data.loader_workers``: which worker, how it
ended), exit 1.

Apart from ``train.run`` (the ``finetune`` entry) so that ``train.evaluate`` can start the same way without
importing the trainer that imports it.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from mimo_sft.config.loader import load_config
from mimo_sft.data.loader_workers import worker_failure
from mimo_sft.errors import UserError
from mimo_sft.parallel.bootstrap import launch_rank_world, launched_by_torchrun, require_launcher
from mimo_sft.train.elastic import record_error, record_pid
from mimo_sft.validate import require_valid


def checked_config(args: list[str], world: int | None, *, refuse_reused_output_dir: bool = False,
                   started_by: str | None = None):
    """``(cfg, check result)`` of ``args`` for a run of ``world`` ranks (None: one rank without a launcher), or the
    ``UserError`` that lists every problem: what every rank checks, and what ``mimo-sft ... --nproc-per-node``
    checks once before it starts them (``train.elastic``; ``started_by``: its flags, named when the processes
    they start are not the ranks the components use)."""
    cfg = load_config(args)
    if world is not None and cfg.parallel.world_size not in (None, world):
        raise UserError(f"--world-size {cfg.parallel.world_size} but {processes(world)} "
                        f"{'was' if world == 1 else 'were'} started; drop --world-size or start "
                        f"{processes(cfg.parallel.world_size)}")
    implied = _implied_world(cfg) if started_by is not None and cfg.parallel.world_size is None else None
    if implied is not None and implied != world:
        raise UserError(f"{started_by} start{'s' if world == 1 else ''} {processes(world)}, but the components use "
                        f"{implied} rank{'s' if implied != 1 else ''}; make "
                        f"--nnodes x --nproc-per-node {implied}, or change the components' dp/tp/pp/rank_offset")
    result = require_valid(cfg, world_size=world, for_run=True)
    if world is None:
        require_launcher(result.layout.world_size)
    if refuse_reused_output_dir:
        _refuse_reused_output_dir(cfg, cfg.logging.output_dir)
    return cfg, result


def processes(n: int) -> str:
    """``1 process``, ``4 processes``."""
    return f"{n} process{'es' if n != 1 else ''}"


def _implied_world(cfg) -> int | None:
    """The ranks the components use (None when they are not readable: the checks then say why)."""
    try:
        specs = cfg.parallel.specs()
    except UserError:
        return None
    return max((s.rank_offset + s.size for s in specs), default=None)


def launch_checked(args: list[str], body, *, refuse_reused_output_dir: bool = False) -> int:
    """Load and check the config on every rank, then ``body(cfg, layout)``; errors as described above
    (shared by ``finetune`` and ``evaluate``)."""
    rank, world = launch_rank_world()
    record_pid(rank)  # under mimo-sft's launcher: the parent forwards a scheduler's SIGUSR1 to it
    try:
        cfg, result = checked_config(args, world if launched_by_torchrun() else None,
                                     refuse_reused_output_dir=refuse_reused_output_dir)
    except UserError as e:
        _refuse(rank, e)
        return 2
    try:
        from mimo_sft.quiet import quiet_libraries

        quiet_libraries()
        return body(cfg, result.layout)
    except UserError as e:
        _abort(f"error: [rank {rank}] {e}", 2)
    except KeyboardInterrupt:
        _abort(f"[rank {rank}] interrupted", 130)
    except Exception as e:  # noqa: BLE001 - decide between "a dead loader worker", "a peer died" and "our bug"
        text = str(e)
        worker = worker_failure(e)
        if worker is not None:
            _abort(f"error: [rank {rank}] {worker}", 1)
        if any(s in text for s in PEER_FAILURE_MARKERS):
            _abort(f"error: [rank {rank}] stopped because another rank failed (see its error above)", 1)
        traceback.print_exc()
        _abort(f"error: [rank {rank}] internal error: {type(e).__name__}: {text.splitlines()[0] if text else ''}", 1)


#: how long a rank other than 0 whose config was refused waits before it says so itself: every rank runs the
#: same checks, so rank 0 normally fails too, prints the problems once and torchrun stops the rest meanwhile.
#: Leaving at once instead lets torchrun kill rank 0 before its lines are written (the user sees only exit codes).
REFUSAL_HOLD_S = 10.0


def _refuse(rank: int, err: UserError) -> None:
    """Report a refused config: once, by rank 0; by another rank only when rank 0 did not fail within
    :data:`REFUSAL_HOLD_S` (a check that depends on the rank's node, such as a path it cannot read). Under
    mimo-sft's launcher every rank records its lines and the parent prints the first."""
    lines = "".join(f"error: {p}\n" for p in err.problems)
    if record_error(rank, lines, 2):
        return
    if rank != 0:
        time.sleep(REFUSAL_HOLD_S)  # torchrun ends this process here when rank 0 failed
        lines = "".join(f"error: [rank {rank}] {p}\n" for p in err.problems)
    sys.stderr.write(lines)
    sys.stderr.flush()


#: what gloo/NCCL report on the surviving ranks when a peer process has died
PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                        "NCCL communicator was aborted", "ProcessGroupNCCL is aborted")


def _abort(message: str, code: int):
    """Print one line and leave at once: a failed rank must not linger in teardown (process-group
    destructors, loader workers), because torchrun stops the other ranks only when this one exits. The line
    is one write, so that two ranks' lines never run together; under mimo-sft's own launcher it goes to the
    parent instead, which prints the first failing rank's (``train.elastic``)."""
    rank, _ = launch_rank_world()
    if not record_error(rank, message, code):
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def _refuse_reused_output_dir(cfg, out_dir: str) -> None:
    """A fresh run must not append to another run's metrics or move its ``latest`` checkpoint back (a run
    started by ``--load-checkpoint auto`` continues its folder: its metrics are cut back to its step)."""
    if cfg.checkpoint.load_checkpoint or cfg.checkpoint.resume_auto:
        return
    save_dir = cfg.checkpoint.save or os.path.join(out_dir, "checkpoints")
    traces = [p for p in (os.path.join(out_dir, "metrics.jsonl"), os.path.join(save_dir, "latest")) if os.path.exists(p)]
    if traces:
        resume = (f"resume it with --load-checkpoint {save_dir}, or " if os.path.exists(os.path.join(save_dir, "latest"))
                  else "")
        raise UserError(f"--output-dir {out_dir} already holds a run ({traces[0]}); {resume}choose a new --output-dir "
                        f"(or delete the old one)")
