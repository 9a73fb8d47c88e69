"""What mimo-sft changes in megatron-core's behaviour on every device (``cpu_shims`` holds the CPU-only
shims). Three changes, each for fewer host syncs in a training step, none editing megatron's files:

* :func:`guard_bridge_debug_logging`: megatron's ``BridgeCommunicator`` (the non-colocated encoder ->
  language bridge) writes ``logging.debug(f"... sum {tensor.sum()}")`` around its sends and receives.
  Python builds an f-string before ``debug`` is called, so with debug logging off every transfer
  still launches a reduction and formats its 0-dim result (``Tensor.__format__`` -> ``.item()``: a
  device sync). A cheap logger check cannot help (the argument is already built), and wrapping the
  tensors' ``__format__`` would leave the ``.sum()`` kernel and change every tensor's formatting. So
  the communicator's methods are recompiled from megatron's own source with each ``logging.debug(...)``
  statement wrapped in ``if logging.root.isEnabledFor(logging.DEBUG):`` -- the test ``logging.debug``
  itself makes -- and nothing else changed: the same code, file and line numbers; with debug logging
  on, the same messages.
* :class:`OrderedGradReduce`: overlapped gradient reduction for a module whose ranks may skip it (a
  vision rank whose micro-batch holds no image). megatron starts a bucket's reduction when all of its
  parameters have their gradient in the last micro-batch, which on a rank that skipped the module
  never happens; and DP ranks must issue their collectives in the same order. Here each rank starts
  the buckets strictly in bucket order (megatron builds bucket 0 from the last parameters, the first
  whose gradients backward produces, so that order is backward's own): as soon as bucket ``i`` and
  every bucket before it are complete, and the rest from :func:`start_pending_grad_reductions` just
  before the finalize. A rank that computed the module starts most of them inside backward, one that
  did not starts all of them at the finalize; the collectives pair up in the same order either way.
* :class:`FiniteGradMimoOptimizer`: one check per step that the gradients are finite, in place of DDP's
  ``check_for_nan_in_grad`` (two host syncs per bucket, inside the overlapped backward): the MIMO grad
  norm is NaN or inf exactly when some module's reduced gradient is, and its one world all-reduce
  carries a flag per module, so every rank refuses the step together, before any weight changes,
  naming the module. What megatron's check told and this one does not: the rank and bucket where the
  NaN first appeared (it checked each rank's local gradient before the reduction, which spreads a NaN
  to every DP rank of the module).
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import math
from functools import partial

import torch
import torch.distributed as dist

from mimo_sft.errors import UserError
from mimo_sft.parallel import runtime  # first: importing mimo_sft.parallel makes megatron importable

from megatron.core.models.mimo.optimizer import MimoOptimizer  # noqa: E402

_BRIDGE_MODULE = "megatron.core.pipeline_parallel.bridge_communicator"
_GUARDED = "_mimo_sft_debug_guarded"


# ---- bridge communicator: debug strings only when debug logging is on ----------------------------------
def _is_debug_call(stmt) -> bool:
    """``logging.debug(...)`` as a statement."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "debug"
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "logging")


class _GuardDebug(ast.NodeTransformer):
    """Wraps every ``logging.debug(...)`` statement in ``if logging.root.isEnabledFor(logging.DEBUG):``."""

    def generic_visit(self, node):
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                setattr(node, field, [self._guard(s) if _is_debug_call(s) else s for s in stmts])
        return node

    @staticmethod
    def _guard(stmt):
        test = ast.parse("logging.root.isEnabledFor(logging.DEBUG)", mode="eval").body
        return ast.fix_missing_locations(ast.copy_location(ast.If(test=test, body=[stmt], orelse=[]), stmt))


def _recompilable(fn: ast.FunctionDef) -> bool:
    """A method can be compiled outside its class body unless it needs the class cell (zero-argument
    ``super()``) or name mangling (``self.__private``)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id in ("super", "__class__"):
            return False
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        if name.startswith("__") and not name.endswith("__"):
            return False
    return True


def guard_debug_logging(module) -> list[str]:
    """Recompile the methods of ``module``'s classes that call ``logging.debug`` with the calls guarded
    (see the module docstring); returns ``Class.method`` of each one replaced. Idempotent."""
    if getattr(module, _GUARDED, None) is not None:
        return getattr(module, _GUARDED)
    filename = inspect.getsourcefile(module)
    tree = ast.parse(inspect.getsource(module), filename)
    replaced = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        target = getattr(module, cls.name, None)
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef) or not any(_is_debug_call(s) for s in ast.walk(fn)):
                continue
            if not inspect.isclass(target) or not _recompilable(fn):
                raise RuntimeError(f"{module.__name__}.{cls.name}.{fn.name}: cannot guard its logging.debug calls")
            code = compile(ast.Module(body=[_GuardDebug().visit(copy.deepcopy(fn))], type_ignores=[]),
                           filename, "exec")
            namespace: dict = {}
            exec(code, module.__dict__, namespace)  # megatron's own code, the module's globals
            method = namespace[fn.name]
            getattr(method, "__func__", method).__qualname__ = f"{cls.name}.{fn.name}"
            setattr(target, fn.name, method)
            replaced.append(f"{cls.name}.{fn.name}")
    setattr(module, _GUARDED, replaced)
    return replaced


def guard_bridge_debug_logging() -> list[str]:
    """:func:`guard_debug_logging` for megatron's ``BridgeCommunicator`` (every device, idempotent)."""
    return guard_debug_logging(importlib.import_module(_BRIDGE_MODULE))


# ---- overlapped reduction for a module some ranks skip ----------------------------------------------------
class OrderedGradReduce:
    """Starts one megatron DDP module's overlapped bucket reductions in bucket order (module docstring).

    Installed on the module's bucket groups: it takes over their ``register_grad_ready`` (what DDP's
    backward hook calls for each parameter of the last micro-batch) and turns off megatron's first-step
    bookkeeping (``is_first_batch``: per-parameter counts learnt in step 1, which a rank that skipped
    the module in step 1 never learns). A parameter counts once per step: its accumulated gradient
    arrives once per backward, and a second arrival after its bucket started would be lost, so it
    stops the run.
    """

    ATTR = "_mimo_sft_ordered_grad_reduce"

    def __init__(self, ddp):
        self.ddp = ddp
        self.groups = list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups)
        self._ready = [set() for _ in self.groups]
        self._next = 0  # the next bucket group to start
        for index, group in enumerate(self.groups):
            group.is_first_batch = False
            group.register_grad_ready = partial(self._grad_ready, index)
        setattr(ddp, self.ATTR, self)

    @classmethod
    def install(cls, ddp) -> "OrderedGradReduce | None":
        """On a DDP module with overlapped reduction (else nothing to order: None)."""
        if not ddp.ddp_config.overlap_grad_reduce:
            return None
        return getattr(ddp, cls.ATTR, None) or cls(ddp)

    def _grad_ready(self, index: int, param, force_all_reduce: bool = False) -> None:
        group = self.groups[index]
        if not group.is_last_microbatch:
            return
        if index < self._next or param in self._ready[index]:
            raise RuntimeError(f"a gradient of {tuple(param.shape)} arrived twice in one step, after its bucket's "
                               f"reduction may have started: this module cannot overlap its reduction")
        self._ready[index].add(param)
        while self._next < len(self.groups) and len(self._ready[self._next]) == len(self.groups[self._next].params):
            self._start_next(force_all_reduce)

    def _start_next(self, force_all_reduce: bool) -> None:
        self.groups[self._next].start_grad_sync(force_all_reduce=force_all_reduce)
        self._next += 1

    def start_pending(self, force_all_reduce: bool = False) -> None:
        """Start, in order, the reductions backward did not start; ready for the next step."""
        while self._next < len(self.groups):
            self._start_next(force_all_reduce)
        self._next = 0
        self._ready = [set() for _ in self.groups]


def start_pending_grad_reductions(ddp, force_all_reduce: bool = False) -> None:
    """Before megatron's finalize waits for ``ddp``'s reductions: start those still pending where the
    module overlaps in bucket order (:class:`OrderedGradReduce`); nothing for any other module."""
    ordered = getattr(ddp, OrderedGradReduce.ATTR, None)
    if ordered is not None:
        ordered.start_pending(force_all_reduce)


# ---- one finite-gradient check per step ---------------------------------------------------------------
class FiniteGradMimoOptimizer(MimoOptimizer):
    """megatron's ``MimoOptimizer`` whose grad norm refuses a non-finite gradient (module docstring)."""

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """megatron's (each module's norm, a world MAX so disjoint grids agree), with a NaN and an inf
        flag per module in the same all-reduce and one host read. Raises on every rank when any
        module's gradient norm is not finite."""
        names = sorted(self.module_infos)
        n = len(names)
        slots = torch.zeros(3 * n, dtype=torch.float32, device=runtime.device())  # norm^2, NaN, inf per module
        for i, name in enumerate(names):
            info = self.module_infos[name]
            norm = info.optimizer.get_grad_norm() if info.is_active and info.optimizer else None
            if norm is None:
                continue
            if isinstance(norm, torch.Tensor):  # megatron keeps it on the device where TE's kernels exist
                norm = norm.reshape(()).float()
                finite = torch.isfinite(norm)
                slots[i] = torch.where(finite, norm * norm, torch.zeros_like(norm))  # a NaN's MAX: backend-defined
                slots[n + i], slots[2 * n + i] = torch.isnan(norm).float(), torch.isinf(norm).float()
            else:
                finite = math.isfinite(norm)
                slots[i], slots[n + i], slots[2 * n + i] = (norm * norm if finite else 0.0, float(math.isnan(norm)),
                                                            float(math.isinf(norm)))
        dist.all_reduce(slots, op=dist.ReduceOp.MAX)
        values = slots.tolist()
        bad = [f"{name} ({'NaN' if values[n + i] else 'inf'})" for i, name in enumerate(names)
               if values[n + i] or values[2 * n + i]]
        if bad:
            raise UserError(f"the gradient norm of {', '.join(bad)} is not finite after the DP reduction: the step "
                            f"is refused before any weight changes (every rank stops); lower --lr or check the data")
        return math.sqrt(sum(values[:n]))
