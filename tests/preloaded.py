"""Run test jobs on ranks forked from a parent that has already imported torch, megatron-core,
transformers, datasets and mimo_sft (the "zygote", ``preloaded_server``), instead of fresh
interpreters started by torchrun or torch.multiprocessing's spawn.

Why: the end-to-end tests start about a hundred torchrun jobs and many spawned process groups; each
rank spends ~6 s of CPU on imports and torchrun ~1 s on itself, most of the suite's time on two cores.
A forked rank starts in milliseconds. ``train_helpers.torchrun`` and ``dist_utils.run_distributed``
use this by default and fall back to the real launchers where it cannot stand in:

* a test that tests torchrun itself passes ``real=True`` (signals, a rank killed mid-save);
* a run whose environment differs from the zygote's in a variable that a preloaded module read at
  import (recorded by the zygote) or that the interpreter and native libraries read at start
  (:data:`STARTUP_PREFIXES`) -- the forked rank would see the zygote's value (:func:`frozen_mismatch`);
* ``MIMO_SFT_TESTS_REAL_TORCHRUN=1`` in the environment, or a zygote that failed to start.

One zygote per test process, started on first use, ended at exit. Every run is killed as a process
group (the supervisor's session) when it ends or times out: a forked rank's ``/proc/PID/environ``
shows the zygote's environment, so the marker search of ``train_helpers`` cannot find it.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from preloaded_server import CLI_ENV_DEFAULTS, MAX_PACKET, RUN_ENV, SCANNED_PREFIXES

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
#: read by the interpreter or by native libraries when a process starts (never by Python code at
#: import): a run whose value differs gets real torchrun
STARTUP_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOMP_", "JE_",
                    "ARROW_", "GLOG_", "CUDA_", "PYTORCH_", "TORCH_CPP_", "TORCH_SHOW_CPP")
#: differences that do not matter: per-test bookkeeping, this launcher's own variables, and
#: PYTHONWARNINGS (which warnings get printed: the zygote runs with the tests' ``ignore``)
IGNORED_KEYS = {"PYTEST_CURRENT_TEST", "MIMO_SFT_TEST_RUN", "PYTHONWARNINGS"}
START_TIMEOUT_S = 600.0
REAL_ENV = "MIMO_SFT_TESTS_REAL_TORCHRUN"


def frozen_mismatch(env: dict, zygote_env: dict, frozen: set[str], set_by_imports: dict | None = None) -> list[str]:
    """The variables whose value in ``env`` a rank forked from the zygote would not see: those
    its imports read (``frozen``) or the interpreter reads at start, where ``env`` differs from what
    the zygote's imports saw. A variable the imports set is also fine at the value they set (a real
    rank that inherits it ends up with the same value)."""
    bad = []
    for key in sorted(set(env) | set(zygote_env)):
        value = env.get(key)
        if key in IGNORED_KEYS or value == zygote_env.get(key):
            continue
        if set_by_imports and key in set_by_imports and value == set_by_imports[key]:
            continue
        if key in frozen or key.startswith(STARTUP_PREFIXES + SCANNED_PREFIXES):
            bad.append(key)
    return bad


class ZygoteError(RuntimeError):
    """The zygote could not serve a request (it died, or did not answer)."""


class Zygote:
    """The client end of one zygote: start it, send requests, collect their answers.

    Threads may share it: each request has an id; whichever waiting thread reads the socket files
    the answers it finds for the others."""

    def __init__(self, env: dict):
        self.dir = Path(tempfile.mkdtemp(prefix="mimo_sft_zygote_"))
        self.log = self.dir / "zygote.log"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(TESTS / "preloaded_server.py"), str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        theirs.close()
        self.sock = ours
        self._ids = iter(range(1, 1 << 62))
        self._cond = threading.Condition()
        self._inbox: dict[int, list[dict]] = {}
        self._reading = False
        self._abandoned: set[int] = set()  # requests whose caller gave up before their run started
        ready = self._recv(time.monotonic() + START_TIMEOUT_S)
        if not ready or not ready.get("ready"):
            self.close()
            raise ZygoteError(f"the zygote did not start: {ready}; log: {self.log.read_text()[-3000:]}")
        self.env, self.frozen, self.set_by_imports = ready["env"], set(ready["frozen"]), ready["set_by_imports"]
        self.threads, self.import_errors = ready["threads"], ready["errors"]
        self.cpu_s, self.runs = 0.0, 0  # CPU seconds of the runs so far (supervisors and ranks), their count

    def _recv(self, deadline: float) -> dict | None:
        """One answer from the socket, or None at the deadline; ZygoteError when the zygote is gone."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([self.sock], [], [], min(left, 1.0))[0]:
                data = self.sock.recv(MAX_PACKET)
                if not data:
                    raise ZygoteError(f"the zygote ended; log: {self.log.read_text()[-3000:]}")
                return json.loads(data)
            if self.proc.poll() is not None:
                raise ZygoteError(f"the zygote ended ({self.proc.returncode}); log: {self.log.read_text()[-3000:]}")

    def _answer(self, req_id: int, deadline: float) -> dict | None:
        """The next answer to request ``req_id`` (None at the deadline). One waiting thread at a
        time reads the socket and files what it reads; the others wait for their answer."""
        while True:
            with self._cond:
                while self._reading and not self._inbox.get(req_id) and time.monotonic() < deadline:
                    self._cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                if self._inbox.get(req_id):
                    return self._inbox[req_id].pop(0)
                if self._reading:
                    return None  # deadline
                self._reading = True
            msg = None
            try:
                msg = self._recv(min(deadline, time.monotonic() + 1.0))
            finally:
                with self._cond:
                    self._reading = False
                    if msg is not None and msg["id"] in self._abandoned:
                        if "pid" in msg:
                            kill_session(msg["pid"])
                    elif msg is not None:
                        self._inbox.setdefault(msg["id"], []).append(msg)
                    self._cond.notify_all()
            if msg is None and time.monotonic() >= deadline:
                return None

    def run(self, req: dict, fds: tuple[int, int], timeout: float) -> int | None:
        """Run one request; its exit code, or None when it ran past ``timeout`` (it is killed then).
        Whatever the run started is killed when it ends, as a scheduler ends a job."""
        req = dict(req, id=next(self._ids))
        socket.send_fds(self.sock, [json.dumps(req).encode()], list(fds))
        deadline = time.monotonic() + timeout
        first = None
        try:
            first = self._answer(req["id"], time.monotonic() + 60.0)
        finally:
            if first is None:  # interrupted (a test timeout) or no answer: kill the run when it starts
                with self._cond:
                    self._abandoned.add(req["id"])
        if first is None or "error" in first:
            raise ZygoteError(f"the zygote did not start the run: {first}")
        pgid = first["pid"]
        try:
            done = self._answer(req["id"], deadline)
        finally:
            kill_session(pgid)
        timed_out = done is None
        if timed_out:  # the kill above ended it; collect the zygote's report
            done = self._answer(req["id"], time.monotonic() + 30.0)
        self.cpu_s += (done or {}).get("cpu_s", 0.0)
        self.runs += 1
        return None if timed_out or done is None else done["exit"]

    def close(self) -> None:
        """End the zygote (closing the socket ends it and the runs it still has) and remove its folder."""
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def kill_session(sid: int) -> None:
    """SIGKILL the process group ``sid`` and every process whose session is ``sid`` (a process that
    moved to a group of its own stays in the session)."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # state ppid pgrp session ...
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue


_LOCK = threading.Lock()
_ZYGOTE: dict[int, Zygote | None] = {}  # pid -> this process's zygote (None: it failed to start)


#: torchrun's per-rank variables: never the zygote's own, even when it starts inside a test that set one for
#: itself (``monkeypatch.setenv("WORLD_SIZE", ...)``): a later run without them would then not match it
LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def zygote_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}
    return {**env, **RUN_ENV, **{k: os.environ.get(k, v) for k, v in CLI_ENV_DEFAULTS.items()}}


def zygote() -> Zygote | None:
    """This process's zygote, started on first use (None where it cannot be: the caller falls back)."""
    if os.environ.get(REAL_ENV) == "1":
        return None
    with _LOCK:
        if os.getpid() not in _ZYGOTE:
            try:
                z = Zygote(zygote_env())
                atexit.register(z.close)
            except (ZygoteError, OSError) as e:
                print(f"preloaded launcher unavailable, using real launchers: {e}", file=sys.stderr)
                z = None
            _ZYGOTE[os.getpid()] = z
        return _ZYGOTE[os.getpid()]


def usable(env: dict) -> Zygote | None:
    """The zygote if a run with ``env`` can be forked from it, else None (with the reason on stderr)."""
    z = zygote()
    if z is None:
        return None
    if z.proc.poll() is not None:  # it died (its log says why): real launchers from now on
        print(f"preloaded launcher: the preloaded parent ended ({z.proc.returncode}); log: "
              f"{z.log.read_text()[-2000:] if z.log.exists() else ''}", file=sys.stderr)
        with _LOCK:
            _ZYGOTE[os.getpid()] = None
        return None
    bad = frozen_mismatch(env, z.env, z.frozen, z.set_by_imports)
    if bad:
        print(f"preloaded launcher: {', '.join(bad)} differ from the preloaded parent's (read at import): "
              "using the real launcher", file=sys.stderr)
        return None
    return z


def run_cli(z: Zygote, nproc: int, argv: list[str], *, env: dict, port: int, timeout: float, out, err,
            cwd: str = str(ROOT), module: str = "mimo_sft", torchrun: bool = True) -> int | None:
    """``torchrun --nproc-per-node NPROC --master-port PORT -m MODULE ARGV`` on ranks forked from ``z``
    (:func:`usable` for ``env``), output to the open files ``out`` and ``err``; the exit code
    (torchrun's: 0 or 1), None when it ran past ``timeout`` (it is killed then). ``torchrun=False``:
    ``python -m MODULE ARGV`` (``nproc`` 1), with that process's own exit code."""
    assert torchrun or nproc == 1, "a plain python -m run is one process"
    error_dir = tempfile.mkdtemp(prefix="run_", dir=z.dir)
    try:
        req = {"kind": "cli", "nproc": nproc, "argv": list(argv), "env": env, "cwd": cwd, "port": port,
               "module": module, "error_dir": error_dir, "torchrun": torchrun}
        return z.run(req, (out.fileno(), err.fileno()), timeout)
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)


def run_call(z: Zygote, nproc: int, target, args: tuple, *, timeout: float,
             grace_s: float = 5.0) -> tuple[int | None, dict]:
    """``target(rank, *args)`` on ``nproc`` processes forked from ``z`` (:func:`usable` for this
    process's environment, which they get), ``target`` importable by name as for spawn; their
    stdout/stderr are this process's fds 1 and 2. Returns (exit code, None when it ran past
    ``timeout``; {rank: exit code})."""
    env = dict(os.environ)
    work = tempfile.mkdtemp(prefix="call_", dir=z.dir)
    try:
        payload = os.path.join(work, "payload.pkl")
        with open(payload, "wb") as fh:
            pickle.dump((target, tuple(args)), fh)
        codes_file = os.path.join(work, "codes.json")
        req = {"kind": "call", "nproc": nproc, "env": env, "cwd": os.getcwd(), "sys_path": list(sys.path),
               "payload": payload, "codes_file": codes_file, "grace_s": grace_s, "port": 0}
        sys.stdout.flush()
        sys.stderr.flush()
        code = z.run(req, (1, 2), timeout)
        codes = {}
        if os.path.exists(codes_file):
            with open(codes_file) as fh:
                codes = {int(r): c for r, c in json.load(fh).items()}
        return code, codes
    finally:
        shutil.rmtree(work, ignore_errors=True)
