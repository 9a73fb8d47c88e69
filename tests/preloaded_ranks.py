"""Supervisor and ranks of one preloaded run (forked by ``preloaded_server``), standing in for torchrun.

A request is either ``{"kind": "cli"}`` -- run ``python -m MODULE ARGV`` (``mimo_sft`` by default) on
``nproc`` ranks, as ``torchrun --nproc-per-node N --master-port P -m MODULE ARGV`` would -- or
``{"kind": "call"}`` -- call a pickled ``target(rank, *args)`` on ``nproc`` processes (what
``dist_utils.run_distributed`` used torch.multiprocessing's spawn for). ``{"kind": "cli",
"torchrun": false}`` is a plain ``python -m MODULE ARGV`` (one process, no torchrun variables, its own
exit code: what the tests' ``subprocess.run([sys.executable, "-m", "mimo_sft", ...])`` do).

What torchrun does that the tests see, and what is done here the same way:

* each rank's environment: the run's, plus the variables torchrun's agent sets (``RANK``,
  ``LOCAL_RANK``, ``GROUP_RANK``, ``ROLE_RANK``, ``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``, ``TORCHELASTIC_*`` ...; torch/distributed/elastic/agent/server/local_elastic_agent.py);
* the rendezvous store is the agent's: a ``TCPStore`` on ``MASTER_PORT`` hosted by the supervisor,
  which the ranks reach as clients (``TORCHELASTIC_USE_AGENT_STORE=True``), so it outlives rank 0;
* every rank writes to the run's stdout and stderr files (torchrun's ranks inherit its own);
* when a rank fails the others get SIGTERM, then SIGKILL after 30 s; the exit code is 0 when every
  rank exits 0 and 1 otherwise (torchrun's ``ChildFailedError``); a one-line summary per failed rank
  goes to stderr (torchrun prints its own, longer one -- no test reads it);
* a rank ends as an interpreter does: non-daemon threads joined, atexit handlers run, streams
  flushed, then ``os._exit`` (the preloaded parent's own exit path is never taken).

The supervisor starts a session of its own, so that its process group holds every rank and every
process a rank starts (megatron's checkpoint writers included): the client kills that group after the
run and at its timeout.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import pickle
import random
import signal
import sys
import time
import traceback

_PR_SET_PDEATHSIG = 1
#: how long a failed run's other ranks get between SIGTERM and SIGKILL (torchrun's agent: 30 s)
STOP_GRACE_S = 30.0


def _die_with_parent() -> None:
    """SIGKILL this process when the one that forked it ends (a safety net behind the client's kills)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def start_supervisor(req: dict, fds: list[int], sock) -> int:
    """Fork the supervisor of one run; returns its pid (also its session and process group id)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        sock.close()
        os.setsid()
        _die_with_parent()
        code = _supervise(req, fds)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _agent_env(req: dict, rank: int) -> dict[str, str]:
    n = str(req["nproc"])
    env = {"RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
           "LOCAL_WORLD_SIZE": n, "WORLD_SIZE": n, "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": n,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(req["port"]), "TORCHELASTIC_RESTART_COUNT": "0",
           "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": req["env"].get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
           "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "LOCAL_RANK": str(rank)}
    if req.get("error_dir"):
        env["TORCHELASTIC_ERROR_FILE"] = os.path.join(req["error_dir"], str(rank), "error.json")
    return env


def _supervise(req: dict, fds: list[int]) -> int:
    """torchrun's agent for one run: the store (``cli`` runs), the ranks, their failure handling; the
    run's exit code (0, or 1 when a rank failed or the store could not start)."""
    os.dup2(fds[1], 2)  # the supervisor's own lines (store failure, summary) go to the run's stderr
    torchrun = req["kind"] == "cli" and req.get("torchrun", True)
    store = _start_store(req["port"]) if torchrun else None
    if isinstance(store, str):  # e.g. EADDRINUSE: the client retries on a new port
        print(f"preloaded launcher: the agent store on port {req['port']} failed: {store}", file=sys.stderr,
              flush=True)
        return 1
    ranks = {}
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank_main(req, rank, fds)  # never returns
        ranks[pid] = rank
    codes = _reap(ranks, req.get("grace_s", STOP_GRACE_S))
    if req["kind"] == "cli" and not torchrun:
        _exit_like(codes[0])  # a plain python process: its own status
    if store is not None:  # torchrun's agent closes its store once the ranks are gone
        _kill_all({store: "store"}, signal.SIGKILL)
        try:
            os.waitpid(store, 0)
        except ChildProcessError:  # already reaped by _reap's waitpid(-1)
            pass
    failed = {r: c for r, c in sorted(codes.items()) if c != 0}
    for rank, c in failed.items():
        print(f"preloaded launcher: rank {rank} (local_rank {rank}) failed, exitcode {c}", file=sys.stderr,
              flush=True)
    if req.get("codes_file"):
        with open(req["codes_file"], "w") as fh:
            json.dump({str(r): c for r, c in codes.items()}, fh)
    return 1 if failed else 0


def _exit_like(code: int) -> None:
    """End this process with ``code``, or by the signal ``-code`` (as the process it stands for did)."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _start_store(port: int):
    """torchrun's static rendezvous store (``StaticTCPRendezvous``: multi-tenant, hosted by the agent),
    in a child of its own, so that the supervisor that forks the ranks never has a thread (the
    store's server runs one). Returns the child's pid once the store listens, or the error text."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        _die_with_parent()
        try:
            import torch.distributed as dist

            store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=900),
                                  wait_for_workers=False, multi_tenant=True)
            os.write(wfd, b"ok")
            while store is not None:
                signal.pause()
        except BaseException as e:
            os.write(wfd, str(e).encode()[:4000] or b"error")
        os._exit(1)
    os.close(wfd)
    answer = b""
    while answer != b"ok":
        chunk = os.read(rfd, 4096)
        if not chunk:
            break
        answer += chunk
    os.close(rfd)
    if answer == b"ok":
        return pid
    os.waitpid(pid, 0)
    return answer.decode(errors="replace") or "the store process ended"


def _kill_all(ranks: dict[int, int], sig: int) -> None:
    for pid in ranks:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap(ranks: dict[int, int], grace_s: float | None) -> dict[int, int]:
    """Wait for every rank; after the first failure SIGTERM the rest, SIGKILL them ``grace_s`` later."""
    codes: dict[int, int] = {}
    live = dict(ranks)
    kill_at = None
    while live:
        pid, status = os.waitpid(-1, os.WNOHANG if kill_at is not None else 0)
        if pid == 0:
            if time.monotonic() >= kill_at:
                _kill_all(live, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.05)
            continue
        if pid not in live:
            continue  # not a rank (cannot happen: ranks are this process's only children)
        codes[live.pop(pid)] = code = os.waitstatus_to_exitcode(status)
        if code != 0 and kill_at is None and grace_s is not None:
            _kill_all(live, signal.SIGTERM)
            kill_at = time.monotonic() + grace_s
    return codes


def _rank_main(req: dict, rank: int, fds: list[int]) -> None:
    """One rank: environment, working directory, streams, then the command; exits the process."""
    code = 1
    try:
        _die_with_parent()
        os.environ.clear()
        os.environ.update(req["env"])
        for key, value in req["set_by_imports"].items():  # what a real rank's own imports set
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if req["kind"] == "cli" and req.get("torchrun", True):
            os.environ.update(_agent_env(req, rank))
        os.chdir(req["cwd"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        _fresh_random_state()
        code = _run_cli(req) if req["kind"] == "cli" else _run_call(req, rank)
        code = _interpreter_exit(code)
    except BaseException:
        try:
            traceback.print_exc()
        finally:
            os._exit(1)
    os._exit(code)


def _fresh_random_state() -> None:
    """A real rank starts with its own random state; a forked one would share the parent's.
    (``random`` reseeds itself after a fork; numpy's global generator does not. torch's default
    generator starts from its fixed seed in both.)"""
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _exit_status(code) -> int:
    """``SystemExit.code`` as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_cli(req: dict) -> int:
    """``python -m MODULE ARGV``: ``sys.path[0]`` is the working directory, as ``-m`` makes it."""
    import runpy

    sys.path[0] = os.getcwd()
    sys.argv = [req.get("module", "mimo_sft"), *req["argv"]]
    return _exit_code_of(lambda: runpy.run_module(req.get("module", "mimo_sft"), run_name="__main__", alter_sys=True))


def _run_call(req: dict, rank: int) -> int:
    """``target(rank, *args)`` from a pickle (its module is imported by name, as spawn would)."""
    sys.path[:] = req["sys_path"]

    def call():
        with open(req["payload"], "rb") as fh:
            target, args = pickle.load(fh)
        target(rank, *args)

    return _exit_code_of(call)


def _exit_code_of(body) -> int:
    """The status an interpreter would exit with after running ``body``: 0, a ``SystemExit``'s code, or 1
    after printing an uncaught exception's traceback the way Python does."""
    try:
        body()
        return 0
    except SystemExit as e:
        return _exit_status(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def _interpreter_exit(code: int) -> int:
    """What ``Py_FinalizeEx`` does before the process ends: join non-daemon threads, run atexit
    handlers, flush the standard streams (a failed flush makes the exit code 120, as there)."""
    import atexit
    import threading

    try:
        threading._shutdown()
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = code or 120
    return code
