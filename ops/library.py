"""``torch.library`` registrations of the ``kimi`` op family.

``attn_res``, ``attn_res_capture`` and ``attn_res_mix`` are defined with
``torch.library.Library`` and their kernels registered per dispatch key, not with
``torch.library.custom_op``: a ``custom_op`` wraps every call in Python layers (an autograd
kernel, a version-bump kernel for mutated inputs, an aliasing check of the outputs) that
cost more than the mixture itself at decode sizes (docs/design.md section 9). Here a call
is one Python kernel, the autograd one (``register_autograd_kernel``: ``_NoFormula`` for
the mutating ops, ``_MixFunction`` in ``backward.py`` for ``attn_res_mix``): where the next
kernel would be our own CPU one, it calls that function itself (``below_autograd``) rather
than have the dispatcher box the arguments into Python a second time. The ops stay opaque
(AOTAutograd keeps each one a single node, so the passes find ``kimi.attn_res`` in
post-grad graphs), are tagged ``pt2_compliant_tag`` as a ``custom_op`` is, and pass
``torch.library.opcheck``. The CPU kernel is the eager path in ``cpu.py``; CUDA
dispatches to the Triton kernel. Fake kernels run the same validation, so a bad model
fails at compile time.

- ``attn_res``: docs/design.md section 3; mutates ``prefix`` (delta) and ``blocks`` (write).
- ``attn_res_capture``: the same, also returning the pre-norm mixture. The
  aux-stream pass swaps a tap's consumer to it, so a tap costs one ``[T,H]`` write.
- ``attn_res_mix``: the pure pre-norm mixture, no mutation.
- ``attn_res_quant`` / ``attn_res_quant_capture``: ``attn_res`` / ``attn_res_capture`` with
  the output quantized per token to FP8 (``fp8_quant.py``): ``(data, scale[, mixed])``.
- ``aux_tap``: the tap marker (a ``custom_op``); the aux-stream pass removes every one.

The arguments of ``attn_res`` and ``attn_res_capture`` are one record, ``AttnResArgs``;
those of the quant ops ``AttnResQuantArgs``; those of ``attn_res_mix`` another, ``MixArgs``
(``ops/attn_res_args.py``): the schemas are inferred from their fields, and every kernel
takes the record (``attn_res_mix``'s in its ``AttnResArgs`` form, ``AttnResArgs.mix``).
"""

from __future__ import annotations

import torch

from .attn_res_args import AttnResArgs, AttnResQuantArgs, MixArgs, record_signature
from .conventions import MUTATED_ARGS
from .cpu import attn_res_cpu, attn_res_quant_cpu, mix_cpu
from .validate import validate_quant, validate_sources, validate_tap

_LIB = torch.library.Library("kimi", "FRAGMENT")  # noqa: TOR901  (ops live as long as the module)


#: op overload -> its CPU kernel (the Python function ``_define`` registered).
_CPU_KERNELS: dict = {}
_CPU = torch._C.DispatchKey.CPU


def _define(fn, mutates_args=()):
    """Define ``kimi::<fn name>`` with the schema ``custom_op`` would infer from ``fn`` and
    register ``fn`` as its CPU kernel; returns the op (``torch.ops.kimi.<name>``)."""
    name = fn.__name__
    schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
    _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, fn, "CPU")
    op = getattr(torch.ops.kimi, name)
    _CPU_KERNELS[op.default] = fn
    return op


_AFTER_AD_INPLACE = torch._C._after_ADInplaceOrView_keyset
_BELOW_AD_INPLACE = torch._C._AutoDispatchBelowADInplaceOrView
#: A dispatch key set (``raw_repr()``) -> whether CPU is the first key below autograd: a
#: function of the key set alone, so cached (a dict lookup costs less than the two key-set
#: calls); a process meets a handful of key sets.
_CPU_NEXT: dict[int, bool] = {}


def below_autograd(op, keyset, args):
    """What an Autograd kernel of ``op`` runs when no gradient is recorded: the kernels
    below it. Where the next one is the CPU kernel (the keys between, ADInplaceOrView,
    fall through or were handled by the caller), call that Python function directly:
    through ``op.redispatch`` the dispatcher would unbox the arguments and box them into
    Python again, a cost of the order of the C kernel's own at decode sizes (docs/design.md
    section 9). Any other key next (Python for fake tensors and dispatch modes,
    Functionalize, Meta, CUDA) goes through the dispatcher (``op.redispatch``)."""
    raw = keyset.raw_repr()
    cpu_next = _CPU_NEXT.get(raw)
    if cpu_next is None:
        cpu_next = _CPU_NEXT[raw] = (
            (keyset & _AFTER_AD_INPLACE).highestPriorityTypeId() == _CPU)
    with _BELOW_AD_INPLACE():
        if cpu_next:
            return _CPU_KERNELS[op](*args)
        return op.redispatch(keyset & _AFTER_AD_INPLACE, *args)


def register_autograd_kernel(op, record, run=below_autograd):
    """Register ``op``'s Autograd kernel: ``record(keyset, *args)`` (an
    ``autograd.Function``'s apply) when a gradient is recorded, else ``run(op, keyset,
    args)``; every op ``_define`` defines gets one."""

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return record(keyset, *args)
        return run(op, keyset, args)

    _LIB.impl(op._opname, kernel, "Autograd", with_keyset=True)


@record_signature(AttnResArgs, returns=torch.Tensor)
def attn_res(*args) -> torch.Tensor:
    a = AttnResArgs(*args)
    validate_sources(a)
    return attn_res_cpu(a, capture=False)[0]


@record_signature(AttnResArgs, returns=tuple[torch.Tensor, torch.Tensor])
def attn_res_capture(*args) -> tuple[torch.Tensor, torch.Tensor]:
    a = AttnResArgs(*args)
    validate_sources(a)
    out, mixed = attn_res_cpu(a)
    if out is mixed:  # no output norm: the two outputs may not alias
        mixed = mixed.clone()
    return out, mixed


@record_signature(MixArgs, returns=torch.Tensor)
def attn_res_mix(*args) -> torch.Tensor:
    a = AttnResArgs.mix(*args)
    validate_sources(a)
    return mix_cpu(a)


@record_signature(AttnResQuantArgs, returns=tuple[torch.Tensor, torch.Tensor])
def attn_res_quant(*args) -> tuple[torch.Tensor, torch.Tensor]:
    q = AttnResQuantArgs(*args)
    validate_quant(q)
    return attn_res_quant_cpu(q, capture=False)


@record_signature(AttnResQuantArgs, returns=tuple[torch.Tensor, torch.Tensor, torch.Tensor])
def attn_res_quant_capture(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = AttnResQuantArgs(*args)
    validate_quant(q)
    return attn_res_quant_cpu(q, capture=True)


attn_res = _define(attn_res, MUTATED_ARGS)
attn_res_capture = _define(attn_res_capture, MUTATED_ARGS)
attn_res_mix = _define(attn_res_mix)
attn_res_quant = _define(attn_res_quant, MUTATED_ARGS)
attn_res_quant_capture = _define(attn_res_quant_capture, MUTATED_ARGS)


@torch.library.custom_op("kimi::aux_tap", mutates_args=())
def aux_tap_op(x: torch.Tensor, capture_id: int) -> torch.Tensor:
    validate_tap(x, capture_id)
    # An op may not return its input; under kimi_backend this node never runs.
    return x.clone()


# --------------------------------------------------------------------------- autograd

_MUTATED_IDX = tuple(AttnResArgs._fields.index(name) for name in MUTATED_ARGS)
assert _MUTATED_IDX == tuple(AttnResQuantArgs._fields.index(n) for n in MUTATED_ARGS)


class _NoFormula(torch.autograd.Function):
    """A mutating op's call when an input requires grad: runs it, refuses a backward."""

    @staticmethod
    def forward(ctx, op, keyset, *args):
        ctx.op = op
        return _mutate_below_autograd(op, keyset, args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"Trying to backward through {ctx.op} but no autograd formula exists: it "
            f"mutates {' and '.join(MUTATED_ARGS)}, and torch has no autograd for an op that "
            f"mutates its inputs. Train through kimi_passes.ops.attn_res_differentiable / "
            f"attn_res_capture_differentiable (same arguments, same effects).")


def _mutate_below_autograd(op, keyset, args):
    # What custom_op's version-bump kernel does, in the same Python frame as the autograd
    # check: autograd sees prefix and blocks change (a saved copy of either fails loudly).
    for i in _MUTATED_IDX:
        torch.autograd.graph.increment_version(args[i])
    return below_autograd(op, keyset, args)


for _op in (attn_res.default, attn_res_capture.default, attn_res_quant.default,
            attn_res_quant_capture.default):
    register_autograd_kernel(_op, lambda keyset, *args, op=_op: _NoFormula.apply(op, keyset, *args),
                             run=_mutate_below_autograd)


# --------------------------------------------------------------------------- fake kernels
# The dispatcher hands kernels the schema's arguments positionally (it has no keyword-only
# ones), whatever form the caller used: ``*args`` is the record in schema order.


@torch.library.register_fake("kimi::attn_res", lib=_LIB)
def _attn_res_fake(*args):
    a = AttnResArgs(*args)
    validate_sources(a)
    return torch.empty_like(a.prefix)


@torch.library.register_fake("kimi::attn_res_capture", lib=_LIB)
def _attn_res_capture_fake(*args):
    a = AttnResArgs(*args)
    validate_sources(a)
    return torch.empty_like(a.prefix), torch.empty_like(a.prefix)


@torch.library.register_fake("kimi::attn_res_mix", lib=_LIB)
def _attn_res_mix_fake(*args):
    a = AttnResArgs.mix(*args)
    validate_sources(a)
    return torch.empty_like(a.prefix)


def _quant_outputs(q: AttnResQuantArgs):
    """The quant ops' new outputs, as every path allocates them: contiguous ``data`` in the
    fp8 dtype, fp32 ``scale`` ``[T, 1]``."""
    T, H = q.prefix.shape
    return (torch.empty((T, H), dtype=q.quant_dtype, device=q.prefix.device),
            torch.empty((T, 1), dtype=torch.float32, device=q.prefix.device))


@torch.library.register_fake("kimi::attn_res_quant", lib=_LIB)
def _attn_res_quant_fake(*args):
    q = AttnResQuantArgs(*args)
    validate_quant(q)
    return _quant_outputs(q)


@torch.library.register_fake("kimi::attn_res_quant_capture", lib=_LIB)
def _attn_res_quant_capture_fake(*args):
    q = AttnResQuantArgs(*args)
    validate_quant(q)
    return (*_quant_outputs(q), torch.empty_like(q.prefix))


@aux_tap_op.register_fake
def _aux_tap_fake(x, capture_id):
    validate_tap(x, capture_id)
    return torch.empty_like(x)


# --------------------------------------------------------------------------- CUDA


def _attn_res_cuda(*args):
    from .triton_kernels import attn_res_triton

    return attn_res_triton(*args)


def _attn_res_capture_cuda(*args):
    from .triton_kernels import attn_res_capture_triton

    return attn_res_capture_triton(*args)


def _attn_res_mix_cuda(*args):
    from .triton_kernels import attn_res_mix_triton

    return attn_res_mix_triton(*args)


def _attn_res_quant_cuda(*args):
    from .triton_kernels import attn_res_quant_triton

    return attn_res_quant_triton(*args)


def _attn_res_quant_capture_cuda(*args):
    from .triton_kernels import attn_res_quant_capture_triton

    return attn_res_quant_capture_triton(*args)


# CUDA dispatches to the Triton kernels (imported lazily: triton is Linux-only).
_LIB.impl("attn_res", _attn_res_cuda, "CUDA")
_LIB.impl("attn_res_capture", _attn_res_capture_cuda, "CUDA")
_LIB.impl("attn_res_mix", _attn_res_mix_cuda, "CUDA")
_LIB.impl("attn_res_quant", _attn_res_quant_cuda, "CUDA")
_LIB.impl("attn_res_quant_capture", _attn_res_quant_capture_cuda, "CUDA")
