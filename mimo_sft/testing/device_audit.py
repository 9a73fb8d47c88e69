"""A stand-in device for the CPU: what a GPU run would put on the device, and what it would read back.

Why: on the CPU every tensor lives in host memory, so a host tensor that reaches a module whose weights
sit on the GPU passes every CPU test -- the first H200 run crashed at step 1 on exactly that (a host
``grid_thw`` turned into an index into a CUDA ``pos_embed``). And a value read back to the host
(``.item()``, ``.tolist()``, ``nonzero``, a copy to the CPU) costs nothing on the CPU but waits for every
queued kernel on a GPU: the first profile showed 667 such syncs in one step.

How: :class:`StandIn` is a tensor that reports the ``meta`` device while its bytes stay in a real host
tensor (``inner``), so every value is the one a CPU run computes and the run trains exactly as on the
CPU. :class:`DeviceAudit` (a ``TorchDispatchMode``) sees every aten op of the thread that enters it:

* an op given a stand-in (device) tensor and a host tensor with at least one dimension is *mixed*: on a
  GPU it fails ("Expected all tensors to be on the same device") or copies behind the caller's back;
  0-dim host tensors are scalars, which CUDA kernels take;
* reading a device value on the host is a *read* (a device sync on a GPU): ``_local_scalar_dense``
  (``.item()``, ``float()``, ``bool()``), ``tolist()``, ``numpy()``, a copy to the CPU, and the ops whose
  output size depends on the data (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` without
  ``output_size``, boolean-mask indexing, ``equal``), plus ``torch.cuda.synchronize`` as megatron calls it
  through the CPU shims;
* a factory given the stand-in device makes a host tensor and wraps it; a host-to-device copy wraps too.

Each finding is recorded with its op, the first call site outside torch, and the training thread's phase
(``mimo_sft.progress``). Nothing is swallowed: an op that fails here fails the audit. A plain ``meta``
tensor (one without bytes, made where the mode could not see it) is an error, never a silent result.

Use: ``runtime.use_device(STANDIN_DEVICE)`` (the CPU shims then send megatron's CUDA allocations to the
stand-in), then everything inside ``with DeviceAudit() as audit:``. ``testing.audit_run`` runs a real
training step of every family this way.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: the device stand-in tensors report (the process's device under the audit)
STANDIN_DEVICE = torch.device("meta")
_ACTIVE: list = []  # the audits entered (innermost last): printing a stand-in tensor is recorded there

#: ops whose output size depends on the values (a GPU waits for the data to size the result)
_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                   aten.unique_consecutive.default, aten.equal.default, aten.bincount.default,
                   aten.is_nonzero.default, aten._local_scalar_dense.default}


class StandIn(torch.Tensor):
    """A tensor on the stand-in device whose values live in ``inner`` (host memory)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        assert type(inner) is torch.Tensor and inner.device.type == "cpu", (type(inner), inner.device)
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                  storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                  device=STANDIN_DEVICE, requires_grad=inner.requires_grad,
                                                  layout=inner.layout)
        out.inner = inner
        return out

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inners, meta, outer_size, outer_stride):
        return StandIn(inners["inner"])

    def __repr__(self):  # printing a device tensor reads its values back (``__format__`` of a 0-dim one too)
        if _ACTIVE:
            _ACTIVE[-1].record("read", "repr")
        return f"StandIn({self.inner!r})"

    def __format__(self, spec):
        if self.dim() == 0:
            if _ACTIVE:
                _ACTIVE[-1].record("read", "format")
            return self.inner.item().__format__(spec)
        return object.__format__(self, spec)

    # ``t.data = other`` (megatron's ``make_viewless_tensor``, its buffers' ``param.data = view``) swaps what
    # the tensor holds without a dispatch: the wrapper's metadata and its host bytes change together
    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        assert isinstance(new, StandIn), f"a host tensor {tuple(new.shape)} assigned as a device tensor's .data"
        torch._C.TensorBase.data.__set__(self, new)
        self.inner = new.inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"a stand-in device tensor reached {func} outside the device audit "
                           f"(another thread, or after the audit ended)")


@dataclass
class Finding:
    kind: str  # "read" | "mixed"
    op: str
    site: str
    phase: str


@dataclass
class AuditLog:
    """What the audit saw: host reads and mixed ops (each with its site and phase), host-to-device copies."""

    findings: list = field(default_factory=list)
    h2d_copies: int = 0
    #: copies to the host asked for with ``non_blocking=True`` (no wait at the copy; the reader synchronizes)
    d2h_async: int = 0
    #: device ops dispatched that compute (views left out): roughly the kernels a GPU would launch, by phase
    ops: collections.Counter = field(default_factory=collections.Counter)

    def reads(self) -> list:
        return [f for f in self.findings if f.kind == "read"]

    def mixed(self) -> list:
        return [f for f in self.findings if f.kind == "mixed"]

    def count_by(self, kind: str, key: str = "site") -> dict:
        return dict(collections.Counter(getattr(f, key) if key != "op+site" else f"{f.op}  {f.site}"
                                        for f in self.findings if f.kind == kind))

    def take(self) -> "AuditLog":
        """What was seen so far (the log starts again empty)."""
        out = AuditLog(self.findings, self.h2d_copies, self.d2h_async, self.ops)
        self.findings, self.h2d_copies, self.d2h_async, self.ops = [], 0, 0, collections.Counter()
        return out


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SKIPPED = (_TORCH_DIR, os.path.abspath(__file__), os.path.join("mimo_sft", "parallel", "cpu_shims.py"))


def call_site() -> str:
    """``path:line function`` of the first frame outside torch, this module and the CPU shims (paths after
    ``site-packages/`` or the project root)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_SKIPPED[:2])
                                 or frame.f_code.co_filename.endswith(_SKIPPED[2])):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
    for marker in ("site-packages" + os.sep, root):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


def _phase() -> str:
    from mimo_sft.progress import PROGRESS

    return PROGRESS.phase


_VIEWS: dict = {}


def _is_view(func) -> bool:
    """An op whose result aliases its input without writing (a view, ``detach``): no kernel on a GPU."""
    if func not in _VIEWS:
        returns = func._schema.returns
        _VIEWS[func] = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    return _VIEWS[func]


def _is_device(t) -> bool:
    return isinstance(t, StandIn)


def _host_array(t) -> bool:
    """A host tensor a GPU kernel would refuse beside device tensors (a 0-dim one is a scalar it takes)."""
    return isinstance(t, torch.Tensor) and not isinstance(t, StandIn) and t.device.type == "cpu" and t.dim() > 0


def _target(kwargs) -> torch.device | None:
    dev = kwargs.get("device")
    return None if dev is None else torch.device(dev)


class DeviceAudit(TorchDispatchMode):
    """Runs every op of the entering thread on host bytes while tracking which tensors are "on the device"
    (:class:`StandIn`), and logs each mixed op and host read (module docstring)."""

    def __init__(self):
        super().__init__()
        self.log = AuditLog()
        self._patches = contextlib.ExitStack()

    def record(self, kind: str, op: str) -> None:
        self.log.findings.append(Finding(kind, op, call_site(), _phase()))

    def read_back(self, t: "StandIn", op: str) -> torch.Tensor:
        """A device tensor's host copy, recorded as a read."""
        self.record("read", op)
        return t.inner.clone()

    # ---- the dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        bare = [t for t in leaves if isinstance(t, torch.Tensor) and not isinstance(t, StandIn) and t.is_meta]
        assert not bare, f"{func} got a meta tensor without values (made where the device audit could not see it)"
        on_device = any(_is_device(t) for t in leaves)
        target = _target(kwargs)
        to_device = target is not None and target.type == STANDIN_DEVICE.type
        if to_device:
            kwargs = dict(kwargs, device=torch.device("cpu"))
        if (on_device or to_device) and not _is_view(func):
            self.log.ops[_phase()] += 1
        if on_device:
            self._classify(func, args, kwargs, leaves, target)
        elif to_device and func in (aten._to_copy.default, aten.copy_.default):
            self.log.h2d_copies += 1
        inner_args, inner_kwargs = pytree.tree_map(lambda t: t.inner if _is_device(t) else t, (args, kwargs))
        try:
            out = func(*inner_args, **inner_kwargs)
        except Exception as err:  # never swallowed: the op is named, and the audit fails with it
            err.add_note(f"device audit: {func} at {call_site()}")
            raise
        if not on_device and not to_device:
            return out
        if func is aten._to_copy.default and target is not None and target.type == "cpu":
            return out  # a copy to the host stays a host tensor (recorded as a read)
        mine = {id(t.inner): t for t in leaves if _is_device(t)}
        return pytree.tree_map(lambda t: (mine[id(t)] if id(t) in mine else StandIn(t))
                               if type(t) is torch.Tensor else t, out)

    def _classify(self, func, args, kwargs, leaves, target) -> None:
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        if func in _DATA_DEPENDENT or self._data_dependent(func, args):
            self.record("read", name)
            return
        if func is aten._to_copy.default and target is not None and target.type == "cpu":
            if not kwargs.get("non_blocking", False):
                self.record("read", name)
            else:  # an asynchronous copy to the host does not wait; whoever uses it synchronizes (recorded there)
                self.log.d2h_async += 1
            return
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if _is_device(src) and not _is_device(dst):
                self.record("read", name)
            elif _is_device(dst) and not _is_device(src):
                self.log.h2d_copies += 1
            return
        if any(_host_array(t) for t in leaves):
            self.record("mixed", name)

    @staticmethod
    def _data_dependent(func, args) -> bool:
        if func is aten.repeat_interleave.Tensor:
            return True  # without output_size the result's length is read from the device
        masks = func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
        if masks and func is not aten.index.Tensor:
            # a boolean mask set to one value is a masked_fill: ``x[mask] = 0`` builds its 0-dim value on the host
            # for a CUDA ``x`` (torch's setitem), so no read; any other value is gathered by nonzero (a read).
            # (Here a Python scalar's value arrives on the stand-in device, so a 0-dim value is taken as a scalar.)
            value = args[2]
            return not (isinstance(value, torch.Tensor) and value.dim() == 0)
        return masks

    # ---- the entry points that bypass dispatch -------------------------------------------------------
    def __enter__(self):
        super().__enter__()
        _ACTIVE.append(self)
        audit = self
        original_tolist, original_numpy = torch.Tensor.tolist, torch.Tensor.numpy

        def tolist(t):
            if _is_device(t):
                audit.record("read", "tolist")
                return t.inner.tolist()
            return original_tolist(t)

        def numpy(t, *a, **k):
            if _is_device(t):
                audit.record("read", "numpy")
                return t.inner.numpy(*a, **k)
            return original_numpy(t, *a, **k)

        def on_standin(factory):  # torch.tensor(..., device=the stand-in): host bytes, then "copied" over
            def make(data, *a, device=None, **k):
                if any(_is_device(t) for t in pytree.tree_leaves(data)):  # each element read back (a sync each)
                    data = pytree.tree_map(lambda t: audit.read_back(t, "tensor(device values)")
                                           if _is_device(t) else t, data)
                if device is not None and torch.device(device).type == STANDIN_DEVICE.type:
                    audit.log.h2d_copies += 1
                    made = factory(data, *a, **k)
                    return made if _is_device(made) else StandIn(made)
                return factory(data, *a, device=device, **k)

            return make

        self._patches.enter_context(_replaced(torch.Tensor, "tolist", tolist))
        self._patches.enter_context(_replaced(torch.Tensor, "numpy", numpy))
        for name in ("tensor", "as_tensor"):
            self._patches.enter_context(_replaced(torch, name, on_standin(getattr(torch, name))))
        self._patches.enter_context(self._counted_synchronize())
        self._patches.enter_context(_fused_kernels_take_the_stand_in())
        return self

    def __exit__(self, *exc):
        self._patches.close()
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def _counted_synchronize(self):
        """megatron's ``torch.cuda.synchronize()`` (through the CPU shims' stand-ins) waits for the device."""
        from mimo_sft.parallel import cpu_shims

        def synchronize(*a, **k):
            self.record("read", "cuda.synchronize")

        with contextlib.ExitStack() as stack:
            for owner in (cpu_shims._CpuCudaNamespace, cpu_shims._NullStream, cpu_shims._NullEvent):
                stack.enter_context(_replaced(owner, "synchronize", staticmethod(synchronize)
                                              if owner is cpu_shims._CpuCudaNamespace else
                                              (lambda _self, *a, **k: synchronize())))
            yield


@contextlib.contextmanager
def _fused_kernels_take_the_stand_in():
    """torch's fused optimizers check the parameters' device type; the stand-in plays CUDA's part (the
    kernels run on the host bytes)."""
    import torch.optim.optimizer as optim

    original = optim._get_fused_kernels_supported_devices
    with _replaced(optim, "_get_fused_kernels_supported_devices",
                   lambda: [*original(), STANDIN_DEVICE.type]):
        yield


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    saved = owner.__dict__.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if saved is None:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)


def on_device(t: torch.Tensor) -> bool:
    """True for a tensor the audit holds on the stand-in device."""
    return _is_device(t)
