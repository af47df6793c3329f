"""How every ``kimi`` op is registered: one ``torch.library.Library``, kernels per dispatch key.

Each op module (``attn_res_ops.py``, ``mix.py``, ``mix_list.py``, ``aux_tap.py``) registers
its ops with one call of ``register``: the schema inferred from the op's record, the
kernel per device, the fake kernel and the Autograd kernel. Not ``torch.library.custom_op``:
a ``custom_op`` wraps every call in Python layers (an autograd kernel, a version-bump
kernel for mutated inputs, an aliasing check of the outputs) that cost more than the
mixture itself at decode sizes (docs/design.md section 9). Here a call is one Python
kernel, the Autograd one: when no gradient is recorded and the next kernel is our own
CPU one, it calls that function itself (``below_autograd``) rather than have the
dispatcher box the arguments into Python a second time. The ops stay opaque (AOTAutograd
keeps each one a single node, so the passes find ``kimi.attn_res`` in post-grad graphs),
are tagged ``pt2_compliant_tag`` as a ``custom_op`` is, and pass ``torch.library.opcheck``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("kimi", "FRAGMENT")  # noqa: TOR901  (ops live as long as the module)

#: op overload -> its CPU kernel (the Python function ``register`` registered).
_CPU_KERNELS: dict = {}
_CPU = torch._C.DispatchKey.CPU
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


class NoFormula(torch.autograd.Function):
    """An op's call when an input requires grad and the op has no autograd formula: runs
    it (``run(op, keyset, args)``), and its backward raises ``why``."""

    @staticmethod
    def forward(ctx, why, run, op, keyset, *args):
        ctx.why = why
        return run(op, keyset, args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.why)


def no_formula(why: str, run=below_autograd) -> Callable:
    """The ``record`` of ``register`` for an op without a backward: the call runs
    (``run``), a backward through it raises ``why`` (say what to differentiate instead)."""
    return lambda op, keyset, *args: NoFormula.apply(why, run, op, keyset, *args)


def register(fn, *, fake, cuda=None, mutates_args=(), record=None, run=below_autograd,
             any_device=False):
    """Define ``kimi::<fn name>`` with the schema ``custom_op`` would infer from ``fn`` (its
    record's signature, ``attn_res_args.record_signature``); returns ``torch.ops.kimi.<name>``.

    ``fn`` is its CPU kernel (every device's with ``any_device``), ``cuda`` its CUDA kernel,
    ``fake`` its fake kernel. Its Autograd kernel runs ``record(op, keyset, *args)`` (a
    backward formula's ``autograd.Function``; default: ``no_formula``) when a gradient is
    recorded, else ``run(op, keyset, args)``. The kernels take the schema's arguments
    positionally (the dispatcher has no keyword-only ones), whatever form the caller used.
    """
    name = fn.__name__
    schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
    _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, fn, "CompositeExplicitAutograd" if any_device else "CPU")
    if cuda is not None:
        _LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"kimi::{name}", fake, lib=_LIB)
    packet = getattr(torch.ops.kimi, name)
    op = packet.default
    _CPU_KERNELS[op] = fn
    if record is None:
        record = no_formula(f"Trying to backward through {op} but no autograd formula "
                            "exists for it (a backward op is not differentiated again); "
                            "differentiate its forward once", run)

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return record(op, keyset, *args)
        return run(op, keyset, args)

    _LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return packet
