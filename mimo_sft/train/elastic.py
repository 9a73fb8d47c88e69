"""``mimo-sft finetune --nproc-per-node N`` (and ``evaluate``): the run's workers started by mimo-sft itself, through
torch's elastic launch API (``torch.distributed.launcher.api.elastic_launch``, the machinery ``torchrun`` uses),
so that a refused start is one line and a failed run ends in its first failing rank's line, not torchrun's
traceback.

Why not only ``torchrun``: under torchrun every rank checks the config and prints its refusal, then torchrun's
agent raises ``ChildFailedError`` and prints a 35-line traceback after it; and ranks that fail together write
their lines over each other. Here the parent:

1. loads the config and runs every check once (``require_valid`` for the world it is about to start), before
   any worker exists: a bad config is its problems, one line each, exit 2;
2. starts the workers (``python -u -m mimo_sft COMMAND ARGS``, each checking again as under torchrun) with the
   rendezvous torchrun --standalone uses (``c10d`` at ``--master-addr:--master-port``, ``--nnodes`` nodes, the one
   of ``--node-rank`` 0 hosting its store; a free local port on one node) and ``--max-restarts``. The rendezvous,
   not ``--node-rank``, orders the nodes: which node's workers get global ranks 0.. is its choice, as under
   torchrun with ``c10d``;
3. on failure, prints the line of the rank that failed first for a reason of its own (a rank that only saw
   its peer die says so, and is passed over), once, and exits with that rank's code. Each worker writes its
   last line to a file in a folder the parent names (``MIMO_SFT_ERROR_DIR``, :func:`record_error`) instead of
   the console; the parent reads them;
4. with ``--exit-signal-handler``, passes a SIGUSR1 it receives on to its workers (each leaves its pid in the same
   folder): a scheduler's warning before the time limit reaches the ranks that save and stop (:func:`launch`).

``torchrun ... -m mimo_sft finetune`` works exactly as before.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

from mimo_sft.errors import UserError

#: set by the parent for its workers: where each writes its failure line (read by :func:`first_failure`)
ERROR_DIR_ENV = "MIMO_SFT_ERROR_DIR"
#: set by the parent for its workers: its launch flags, so that a stopped run prints the command that started it
#: (``train.stopping.resume_command``: ``mimo-sft finetune --nproc-per-node N ...``, not the torchrun form)
LAUNCH_FLAGS_ENV = "MIMO_SFT_LAUNCH_FLAGS"


def attempt() -> int:
    """Which start of the workers this is (0: the first; torch's agent counts its restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)




#: the launcher's flags (as torchrun spells them), each with a value
FLAGS = {"--nproc-per-node": "nproc_per_node", "--nnodes": "nnodes", "--node-rank": "node_rank",
         "--master-addr": "master_addr", "--master-port": "master_port", "--max-restarts": "max_restarts"}
LAUNCH_HELP = {
    "--nproc-per-node N": "start N worker processes on this node (mimo-sft's own launcher, torch's elastic launch "
                          "API: the config is checked once first, a failure ends in its first rank's line)",
    "--nnodes N / --node-rank R": "a run over N nodes; this is node R (run the same command on each)",
    "--master-addr HOST / --master-port P": "node 0's address and a free port (default: this host, a free port)",
    "--max-restarts N": "restart the workers up to N times after a failure (default 0)",
}


@dataclass
class LaunchOptions:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def flags(self) -> list[str]:
        """The launch flags that start these workers again (the defaults left out)."""
        out = ["--nproc-per-node", str(self.nproc_per_node)]
        for flag, key in FLAGS.items():
            value = getattr(self, key)
            if key != "nproc_per_node" and value != getattr(LaunchOptions, key, None) and value is not None:
                out += [flag, str(value)]
        return out

    @property
    def started_by(self) -> str:
        """The flags that set the number of processes, as a refusal names them."""
        one = f"--nproc-per-node {self.nproc_per_node}"
        return one if self.nnodes == 1 else f"--nnodes {self.nnodes} x {one}"


def split_launch_flags(args: list[str]) -> tuple[LaunchOptions | None, list[str]]:
    """``(launch options, the other args)``; None when ``--nproc-per-node`` is absent (a rank's own start)."""
    found: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        if flag in FLAGS:
            value = inline if inline else (args[i + 1] if i + 1 < len(args) else None)
            if value is None or value.startswith("--"):
                raise UserError(f"{flag} needs a value")
            found[FLAGS[flag]] = value
            i += 1 if inline else 2
            continue
        rest.append(args[i])
        i += 1
    if "nproc_per_node" not in found:
        if found:
            raise UserError(f"{', '.join('--' + k.replace('_', '-') for k in found)} without --nproc-per-node; give "
                            f"--nproc-per-node N to start the workers with mimo-sft's launcher")
        return None, rest
    kw = {}
    for key, value in found.items():
        if key == "master_addr":
            kw[key] = value
            continue
        try:
            kw[key] = int(value)
        except ValueError:
            raise UserError(f"--{key.replace('_', '-')} {value}: give a whole number") from None
    opts = LaunchOptions(**kw)
    if opts.nproc_per_node < 1 or opts.nnodes < 1 or not 0 <= opts.node_rank < opts.nnodes or opts.max_restarts < 0:
        raise UserError(f"--nproc-per-node {opts.nproc_per_node} --nnodes {opts.nnodes} --node-rank {opts.node_rank} "
                        f"--max-restarts {opts.max_restarts}: give N >= 1 processes, nodes >= 1, a node rank below "
                        f"--nnodes and restarts >= 0")
    return opts, rest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_config(opts: LaunchOptions):
    """torch's ``LaunchConfig`` for ``opts``: the ``c10d`` rendezvous at the master's address (torchrun
    ``--standalone``'s on one node). Not the ``static`` one: after a failure its restarted workers read the
    dead workers' addresses from the store it keeps and cannot connect (measured), so ``--max-restarts`` needs a
    rendezvous that opens a new round. Node 0 hosts the store; every node derives the same run id from the
    master's address and port."""
    from torch.distributed.launcher.api import LaunchConfig

    port = opts.master_port or (_free_port() if opts.nnodes == 1 else 29500)
    return LaunchConfig(min_nodes=opts.nnodes, max_nodes=opts.nnodes, nproc_per_node=opts.nproc_per_node,
                        run_id=f"mimo-sft-{opts.master_addr}-{port}", rdzv_backend="c10d",
                        rdzv_endpoint=f"{opts.master_addr}:{port}", rdzv_configs={"is_host": opts.node_rank == 0},
                        max_restarts=opts.max_restarts, monitor_interval=0.1, start_method="spawn")


def record_error(rank: int, line: str, code: int) -> bool:
    """Under mimo-sft's launcher, write this rank's failure line for the parent (True); else False (print it)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return False
    path = os.path.join(folder, f"rank_{rank:05d}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump({"rank": rank, "line": line, "code": code, "time": time.time(), "attempt": attempt(),
                   "peer": "another rank failed" in line}, fh)
    os.replace(tmp, path)
    return True


def first_failure(folder: str) -> dict | None:
    """The failure to report: of the last start of the workers (``--max-restarts``), the earliest of a rank's own
    (not one that only saw a peer die), else the earliest."""
    found = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as fh:
                    found.append(json.load(fh))
            except (OSError, ValueError):
                continue
    return min(found, key=lambda f: (-f.get("attempt", 0), f["peer"], f["time"], f["rank"])) if found else None


def record_pid(rank: int) -> None:
    """Under mimo-sft's launcher, leave this worker's pid for the parent (:func:`forward_signal`)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder:
        with open(os.path.join(folder, f"pid_{rank:05d}"), "w") as fh:
            fh.write(str(os.getpid()))


def forward_signal(folder: str, sig: int) -> list[int]:
    """Send ``sig`` to every worker of this node that left its pid in ``folder``; the pids reached."""
    reached = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.startswith("pid_"):
            continue
        try:
            with open(os.path.join(folder, name)) as fh:
                pid = int(fh.read())
            os.kill(pid, sig)
            reached.append(pid)
        except (OSError, ValueError):  # a worker that has ended, or a file being written
            continue
    return reached


def launch(command: str, opts: LaunchOptions, args: list[str], *, check) -> int:
    """Check once (``check(args, world_size)`` raises ``UserError``), start the workers, report; the exit code.

    With ``--exit-signal-handler`` a SIGUSR1 to this process (a scheduler's warning before its time limit, e.g.
    SLURM's ``--signal``, forwarded by ``srun``) is passed on to this node's workers, which finish the step, save
    and exit 0 (``train.stopping``); without it SIGUSR1 ends this process as it would any program."""
    try:
        checked = check(args, opts.world_size)
    except UserError as err:
        sys.stderr.write("".join(f"error: {p}\n" for p in err.problems))
        return 2
    cfg = checked[0] if isinstance(checked, tuple) else None
    forward = bool(cfg is not None and cfg.train.exit_signal_handler)
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the agent's own lines: ours says it
    folder = tempfile.mkdtemp(prefix="mimo_sft_errors_")
    os.environ[ERROR_DIR_ENV] = folder  # the workers inherit it
    os.environ[LAUNCH_FLAGS_ENV] = shlex.join(opts.flags())
    previous = signal.signal(signal.SIGUSR1, lambda sig, _frame: forward_signal(folder, sig)) if forward else None
    try:
        elastic_launch(launch_config(opts), sys.executable)("-u", "-m", "mimo_sft", command, *args)
        return 0
    except ChildFailedError as err:
        failure = first_failure(folder)
        if failure is not None:
            sys.stderr.write(failure["line"].rstrip("\n") + "\n")
            return int(failure["code"])
        rank, proc = min(err.failures.items(), key=lambda kv: kv[1].timestamp)
        sys.stderr.write(f"error: [rank {rank}] exited with code {proc.exitcode} before it could say why "
                         f"(killed, or out of memory?)\n")
        return int(proc.exitcode) if proc.exitcode and proc.exitcode > 0 else 1
    finally:
        if forward:
            signal.signal(signal.SIGUSR1, previous)
        os.environ.pop(ERROR_DIR_ENV, None)
        os.environ.pop(LAUNCH_FLAGS_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)
