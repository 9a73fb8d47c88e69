"""What mimo-sft changes in megatron-core's behaviour on every device (``cpu_shims`` holds the CPU-only
shims), none editing megatron's files: the first four for fewer host syncs in a training step, the last for no
compilation at all:

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
  to every DP rank of the module). Without a loss scaler (bf16 and fp32: megatron's fp16 is never
  used) it also skips MimoOptimizer's ``found_inf`` and ``success`` round trips, which can only say
  "finite" and "updated" there: two host reads per step.
* :func:`install_optimizer_kernels`: without Transformer Engine or apex, megatron's optimizer path runs
  its local fallbacks one tensor at a time -- a ``torch.norm`` per gradient gathered by
  ``torch.tensor(list of device scalars)`` (a host read per tensor: 644 of the first H200 profile's 667
  syncs), a ``copy_(src * scale)`` per gradient to clip, a ``copy_`` per parameter from the fp32 main
  weights, and torch's AdamW with ``foreach``. Here the same contracts run a few kernels per bucket:
  ``_foreach_norm`` stacked into one norm that stays on the device, ``_foreach_mul_``, ``_foreach_copy_``,
  and torch's fused AdamW (:func:`use_fused_adam`; its step counters are device tensors, which
  :func:`adam_steps_on_policy` puts right after a checkpoint load in either direction).
* :func:`swiglu_uncompiled`: megatron ``torch.compile``s its fused SwiGLU. Inductor compiles it in the first
  step, and again at the next new packed length (then with dynamic shapes): steps 1 and 2 of the first H200 run
  took 13.5 s and 4.2 s against a 1.03 s median, and on the CPU each compile takes 7-9 s per process. Marking
  the length dynamic (``dynamic=True``) would still compile once in step 1, so here the functions run
  uncompiled on every device -- the same autograd Functions, which keep only fc1's output for backward -- with
  the backward as torch's SiLU backward and a product (:func:`swiglu_grad`). The cost, read rather than
  measured on a GPU: per MLP 2 kernels forward and 4 backward instead of 1 and 1, and about 2.7x the fused
  kernels' memory traffic on these elementwise passes (docs/benchmarks.md puts it at a few milliseconds per
  step for Qwen2.5-VL-3B).
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

from megatron.core.models.mimo import optimizer as mimo_optimizer  # noqa: E402
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


def _recompile(module, cls: ast.ClassDef, fn: ast.FunctionDef, transformer: ast.NodeTransformer) -> None:
    """Replace ``cls.fn`` of ``module`` by megatron's own source of it transformed by ``transformer``, compiled
    in the module's globals with its file and line numbers."""
    target = getattr(module, cls.name, None)
    if not inspect.isclass(target) or not _recompilable(fn):
        raise RuntimeError(f"{module.__name__}.{cls.name}.{fn.name}: cannot be recompiled outside its class")
    code = compile(ast.Module(body=[transformer.visit(copy.deepcopy(fn))], type_ignores=[]),
                   inspect.getsourcefile(module), "exec")
    namespace: dict = {}
    exec(code, module.__dict__, namespace)  # megatron's own code, the module's globals
    method = namespace[fn.name]
    getattr(method, "__func__", method).__qualname__ = f"{cls.name}.{fn.name}"
    setattr(target, fn.name, method)


def _class_methods(module):
    """``(class node, method node)`` of every method defined in ``module``'s source."""
    tree = ast.parse(inspect.getsource(module), inspect.getsourcefile(module))
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef):
                yield cls, fn


def guard_debug_logging(module) -> list[str]:
    """Recompile the methods of ``module``'s classes that call ``logging.debug`` with the calls guarded
    (see the module docstring); returns ``Class.method`` of each one replaced. Idempotent."""
    if getattr(module, _GUARDED, None) is not None:
        return getattr(module, _GUARDED)
    replaced = []
    for cls, fn in _class_methods(module):
        if any(_is_debug_call(s) for s in ast.walk(fn)):
            _recompile(module, cls, fn, _GuardDebug())
            replaced.append(f"{cls.name}.{fn.name}")
    setattr(module, _GUARDED, replaced)
    return replaced


def guard_bridge_debug_logging() -> list[str]:
    """:func:`guard_debug_logging` for megatron's ``BridgeCommunicator`` (every device, idempotent)."""
    return guard_debug_logging(importlib.import_module(_BRIDGE_MODULE))


# ---- bridge shapes on the host ------------------------------------------------------------------------------
class _HostShapes(ast.NodeTransformer):
    """In megatron's ``_communicate_shapes``: every ``device=...`` becomes the host, and ``self.bridge_pg`` the
    bridge's gloo twin ``self._mimo_shape_pg`` (nothing else changes)."""

    def visit_keyword(self, node):
        self.generic_visit(node)
        if node.arg == "device":
            node.value = ast.copy_location(ast.Constant("cpu"), node.value)
        return node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if node.attr == "bridge_pg" and isinstance(node.value, ast.Name) and node.value.id == "self":
            node.attr = "_mimo_shape_pg"
        return node


_SHAPE_GROUPS: dict = {}  # bridge group -> its gloo twin


def host_bridge_shapes() -> bool:
    """megatron's ``BridgeCommunicator`` exchanges each micro-batch's tensor shapes (variable sequence lengths) as
    device tensors it then reads with ``.tolist()``: a device sync per transfer direction and micro-batch on a
    GPU. Here the same code (recompiled from megatron's source, :class:`_HostShapes`) sends them as host tensors
    over a gloo twin of each bridge group, created with it (``parallel.groups.host_twin``); the activations and
    gradients still travel on the bridge group. Install before the bridges are built; True once installed."""
    bc = importlib.import_module(_BRIDGE_MODULE)
    cls = bc.BridgeCommunicator
    if getattr(cls, "_mimo_host_shapes", False):
        return True
    from mimo_sft.parallel.groups import host_twin

    create = cls.__dict__["_get_or_create_bridge_pg"].__func__
    twins: dict = {}

    def get_or_create(klass, ranks):
        group = create(klass, ranks)
        key = tuple(sorted(ranks))
        if key not in twins:  # every rank builds every bridge in the same order: the twins line up
            twins[key] = host_twin(list(key))
        _SHAPE_GROUPS[group] = twins[key]
        return group

    cls._get_or_create_bridge_pg = classmethod(get_or_create)
    cls._mimo_shape_pg = property(lambda self: _SHAPE_GROUPS[self.bridge_pg])
    (found,) = [(c, f) for c, f in _class_methods(bc) if c.name == cls.__name__ and f.name == "_communicate_shapes"]
    _recompile(bc, *found, _HostShapes())
    cls._mimo_host_shapes = True
    return True


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
    def step(self):
        """megatron's step; without a loss scaler on any module, no ``found_inf`` / ``success`` exchange: with
        nothing to unscale ``prepare_grads`` finds no inf, and ``step_with_ready_grads`` always succeeds (a
        non-finite gradient is refused by :meth:`get_grad_norm`, on every rank together). Decided by the config,
        which every rank shares, so all ranks take the same path."""
        if self.config.fp16 or any(_has_loss_scaler(opt) for opt in self._active_optimizers):
            return super().step()
        self.prepare_grads()
        grad_norm = self.get_grad_norm()
        for opt in self._active_optimizers:
            params = opt.get_parameters()
            if params and opt.config.clip_grad > 0.0 and not getattr(opt, "is_stub_optimizer", False):
                # looked up per call as megatron's step does (the CPU shims wrap the name there)
                mimo_optimizer.clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                                            use_decoupled_grad=opt.config.use_precision_aware_optimizer)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        ok = self.step_with_ready_grads()
        assert ok, "an optimizer without a loss scaler reported a failed update"
        return True, grad_norm, num_zeros

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


def _has_loss_scaler(opt) -> bool:
    return any(getattr(o, "grad_scaler", None) is not None for o in getattr(opt, "chained_optimizers", [opt]))


# ---- optimizer kernels per bucket, not per tensor ---------------------------------------------------------
def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron's ``multi_tensor_l2norm`` contract: ``([1] fp32 norm of every tensor of tensor_lists[0], None)``,
    from one ``_foreach_norm`` and one norm of their stack, kept on the device."""
    tensors = tensor_lists[0]
    assert not per_tensor, "per-tensor norms are not asked for on mimo-sft's path"
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """megatron's ``multi_tensor_scale`` contract, ``dst[i] = src[i] * scale`` (``scale`` a float or, as
    ``multi_tensor_scale_tensor``, a one-element device tensor), in a few multi-tensor kernels: in place when
    the two lists are the same tensors (gradient clipping), a copy when the scale is 1 (main weights into the
    model's, fp32 into bf16 included)."""
    src, dst = tensor_lists
    if not src:
        return
    if isinstance(scale, torch.Tensor):
        scale = scale.reshape(())
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif not isinstance(scale, torch.Tensor) and scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _foreach_main_to_model(original):
    """``DistributedOptimizer._copy_main_params_to_model_params`` with one ``_foreach_copy_`` into the param
    buffers' shard views (megatron: a ``copy_`` per parameter); megatron's own for the cases it specialises
    (FSDP, precision-aware, fp8/fp4 param gather)."""

    def copy_main_to_model(self):
        if self.is_stub_optimizer:
            return
        if (self.ddp_config.use_megatron_fsdp or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                or self.ddp_config.fp8_param_gather or self.ddp_config.fp4_param_gather):
            return original(self)
        mains, views = [], []
        for shard_groups, model_groups in ((self.shard_fp32_from_float16_groups, self.model_float16_groups),
                                           (self.shard_fp32_groups, self.model_fp32_groups)):
            for shard_group, model_group in zip(shard_groups, model_groups):
                for main, model_param in zip(shard_group, model_group):
                    world = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                    buffer_index, _, bucket = self.model_param_gbuf_map[model_param]
                    data = self.buffers[buffer_index].buckets[bucket].param_data
                    views.append(data.view(-1)[world.start: world.end])
                    mains.append(main)
        if views:
            torch._foreach_copy_(views, mains)

    copy_main_to_model._mimo_sft_foreach = True
    return copy_main_to_model


def install_optimizer_kernels() -> bool:
    """Replace megatron's per-tensor fallbacks (module docstring) where megatron fell back to them, on every
    device; True when installed (idempotent). With Transformer Engine or apex megatron's own multi-tensor
    kernels stay."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if clip_grads.l2_norm_impl is _foreach_l2_norm:
        return True
    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return False
    clip_grads.l2_norm_impl = _foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = clip_grads.multi_tensor_scale_tensor_impl = _foreach_scale
    optimizer.multi_tensor_scale_impl = _foreach_scale
    original = DistributedOptimizer._copy_main_params_to_model_params
    if not getattr(original, "_mimo_sft_foreach", False):
        DistributedOptimizer._copy_main_params_to_model_params = _foreach_main_to_model(original)
    return True


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a MIMO optimizer (each module's, chained or not)."""
    found = []
    for info in getattr(optimizer, "module_infos", {}).values():
        opt = info.optimizer if info.is_active else None
        for inner in getattr(opt, "chained_optimizers", [opt]) if opt is not None else []:
            if getattr(inner, "optimizer", None) is not None:
                found.append(inner.optimizer)
    return found


def use_fused_adam(optimizer) -> int:
    """torch's fused AdamW for every torch Adam inside ``optimizer`` whose parameters all sit on a device
    its fused kernel serves (one kernel per parameter group instead of foreach's dozen); the number of param
    groups switched. The step counters it then keeps are device tensors (:func:`adam_steps_on_policy`)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    switched = 0
    for opt in torch_optimizers(optimizer):
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in opt.param_groups:
            if all(p.device.type in devices and p.is_floating_point() for p in group["params"]):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


def adam_steps_on_policy(optimizer) -> int:
    """Each torch Adam's per-parameter step where its group's kernel wants it: a float32 tensor on the
    parameter's device for fused (or capturable) groups, a float32 host tensor otherwise. A checkpoint
    written by either kind resumes into the other (torch converts only towards fused ones, and megatron's
    loads set steps of their own). The number of steps moved."""
    moved = 0
    for opt in torch_optimizers(optimizer):
        for group in opt.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                state = opt.state.get(p, {})
                step = state.get("step")
                if not isinstance(step, torch.Tensor):
                    continue
                want = p.device if on_device else torch.device("cpu")
                if step.device != want or step.dtype != torch.float32:
                    state["step"] = step.detach().to(device=want, dtype=torch.float32).clone()
                    moved += 1
    return moved


# ---- megatron's fused SwiGLU, never compiled ------------------------------------------------------------
#: megatron's ``torch.compile``d SwiGLU functions (``jit_fuser``); its autograd Functions call them by these names
_SWIGLU_MODULE = "megatron.core.fusions.fused_bias_swiglu"
_SWIGLU_FUNCTIONS = ("swiglu", "bias_swiglu", "weighted_swiglu", "swiglu_back", "bias_swiglu_back",
                     "weighted_swiglu_back")


def swiglu_uncompiled() -> None:
    """megatron's fused SwiGLU (``bias_activation_fusion``) with nothing compiled, on every device (idempotent;
    ``model.builder`` applies it before it builds). Why and what it costs: module docstring."""
    mod = importlib.import_module(_SWIGLU_MODULE)
    for name in _SWIGLU_FUNCTIONS:
        original = getattr(getattr(mod, name), "_torchdynamo_orig_callable", None)
        if original is not None:
            setattr(mod, name, original)
    mod.swiglu_back = swiglu_grad  # the bias and weighted backwards call it by this name


def swiglu_grad(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of ``silu(a) * b`` for ``y = [a | b]`` (last dimension) given the output's gradient ``g``:
    torch's SiLU backward of ``g * b`` and ``g * silu(a)``, each written into its half of one tensor -- what
    autograd computes for the unfused MLP, bit for bit, in four kernels (megatron's formula run uncompiled takes
    eleven, and computes the sigmoid twice). Operands of two dtypes are promoted first, as megatron's formula does."""
    import torch.nn.functional as F

    dtype = torch.promote_types(g.dtype, y.dtype)
    g, y = g.to(dtype), y.to(dtype)
    gate, up = torch.chunk(y, 2, -1)
    grad = torch.empty_like(y)
    d_gate, d_up = torch.chunk(grad, 2, -1)
    torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=d_gate)
    torch.mul(g, F.silu(gate), out=d_up)
    return grad
