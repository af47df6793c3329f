"""Backward of the AttnRes mixture: ``kimi::attn_res_mix_backward`` and
``kimi::attn_res_mix_list_backward``, and the autograd formulas of ``attn_res_mix`` /
``attn_res_mix_list`` that call them.

Per row, with sources ``v_j`` (``j < n``), folded query ``w = norm_weight * qk_weight``:

    r_j = rsqrt(mean(v_j^2) + eps);  logit_j = <v_j, w> * r_j;  p = softmax(logit)
    out = sum_j p_j v_j

Given ``g = dL/dout``:

    dlogit_j = p_j * (<g, v_j> - <g, out>)          (<g, out> = sum_k p_k <g, v_k>)
    a_j      = dlogit_j * r_j                         (gradient of the dot <v_j, w>)
    dv_j     = p_j g + a_j w - (a_j * logit_j * r_j / H) v_j
    dw       = sum over rows and sources of a_j v_j
    d(norm_weight) = dw * qk_weight;  d(qk_weight) = dw * norm_weight

(the last term of ``dv_j`` is the key-norm path: ``dr_j/dv_j = -r_j^3 v_j / H``).

Nothing is saved by the forward beyond its inputs (which autograd holds anyway): the
backward recomputes the ``[n]`` logits of a row from the sources, which it has to read
for ``<g, v_j>`` regardless. So no ``[T, n, H]`` keys and no ``[T, n]`` statistics live
between forward and backward. The CPU path stages a chunk of rows of all sources in one
cache-sized buffer (one read of each source from memory) and runs both passes (logits
and ``<g, v_j>``, then ``dv`` and ``dw``) on it, writing each ``dv_j`` straight into its
destination; the Triton kernel
(``triton_backward.py``) reads each source twice. Accumulation is fp32 (fp64 for fp64
inputs, which only the tests' gradcheck passes; the ops themselves take the forward's
dtypes). Gradients are rounded to each input's dtype once.
"""

from __future__ import annotations

import torch

from . import library as _library  # noqa: F401  (kimi::attn_res_mix, before its autograd)
from .attn_res_args import (
    MixArgs,
    MixBackwardArgs,
    MixListArgs,
    MixListBackwardArgs,
    record_signature,
)
from .mix_list import validate_mix_list_backward
from .validate import validate_mix_backward

# Rows per chunk: the chunk's staged sources plus their gradients are about this many bytes.
_CHUNK_BYTES = 8 << 20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def mix_backward_rows(grad, sources, q, eps, dsources, dw) -> None:
    """Backward of the mixture of ``sources`` (``n`` tensors ``[R, H]``, views allowed).

    ``grad`` ``[R, H]`` is dL/dout; ``q`` the folded query in the compute dtype. Writes
    dL/dsources[j] into ``dsources[j]`` (a ``[R, H]`` tensor, rounded to its dtype) where
    that is not None, and adds dL/dq into ``dw`` (an ``[H]`` compute-dtype accumulator)
    when ``dw`` is not None.
    """
    R, H = grad.shape
    n, cdt, dev = len(sources), q.dtype, grad.device
    if R == 0 or H == 0:
        for d in dsources:
            if d is not None:
                d.zero_()
        return
    want_dv = any(d is not None for d in dsources)
    # Staged sources and the grad rows: about n + 1 rows of H each (+1 for a rounded dv).
    rows = max(1, min(R, _CHUNK_BYTES // ((n + 2) * H * cdt.itemsize)))
    stage = torch.empty((rows, n, H), dtype=cdt, device=dev)
    gbuf = torch.empty((rows, H), dtype=cdt, device=dev)
    # dv_j is written straight into its destination; one that is not in the compute
    # dtype gets it through this buffer (rounded once by the copy).
    dv_buf = torch.empty((rows, H), dtype=cdt, device=dev) if any(
        d is not None and d.dtype != cdt for d in dsources) else None
    for r0 in range(0, R, rows):
        r1 = min(R, r0 + rows)
        C = r1 - r0
        v, g = stage[:C], gbuf[:C]
        torch.stack([s[r0:r1] for s in sources], dim=1, out=v)  # the one read of each source
        g.copy_(grad[r0:r1])
        # Pass 1: the logits (recomputed, as the forward did) and <g, v_j>.
        r = torch.linalg.vector_norm(v, dim=-1)
        r = r.square_().div_(H).add_(eps).rsqrt_()  # [C, n]
        logit = torch.mv(v.view(C * n, H), q).view(C, n).mul_(r)
        p = torch.softmax(logit, dim=-1)
        gv = torch.bmm(v, g.unsqueeze(-1)).squeeze(-1)  # [C, n]
        g_out = (p * gv).sum(-1, keepdim=True)  # <g, out>
        a = gv.sub_(g_out).mul_(p).mul_(r)  # dlogit_j * r_j
        # Pass 2: dv_j = p_j g + a_j w - c_j v_j, and dw += sum_j a_j v_j.
        if want_dv:
            nc = (a * logit * r).div_(-H)
            for j, d in enumerate(dsources):
                if d is None:
                    continue
                direct = d.dtype == cdt
                dv = d[r0:r1] if direct else dv_buf[:C]  # type: ignore[index]  # None only if all direct
                torch.mul(v[:, j], nc[:, j:j + 1], out=dv)
                dv.addcmul_(g, p[:, j:j + 1])
                dv.addcmul_(a[:, j:j + 1], q)
                if not direct:
                    d[r0:r1].copy_(dv)
        if dw is not None:
            dw.add_(torch.mv(v.view(C * n, H).t(), a.reshape(C * n)))


def attn_res_mix_backward_cpu(b: MixBackwardArgs):
    """``(dprefix, dblocks, dw)``; each an empty ``[0]`` tensor when not asked for.

    ``dblocks`` is ``[T, NB, H]`` with zeros in the slots ``>= num_blocks``; ``dw`` is
    dL/d(norm_weight * qk_weight) in the compute dtype (fp32 for the op's dtypes).
    """
    prefix, blocks, num_blocks = b.prefix, b.blocks, b.num_blocks
    cdt = _compute_dtype(prefix.dtype)
    q = b.norm_weight.to(cdt) * b.qk_weight.to(cdt)
    dprefix = torch.empty_like(prefix) if b.need_prefix else None
    dblocks = None
    if b.need_blocks:
        dblocks = torch.empty_like(blocks, memory_format=torch.contiguous_format)
        dblocks[:, num_blocks:].zero_()
    dw = torch.zeros(q.shape, dtype=cdt, device=q.device) if b.need_weights else None
    sources = [blocks[:, j] for j in range(num_blocks)] + [prefix]
    dsources = [None if dblocks is None else dblocks[:, j] for j in range(num_blocks)]
    mix_backward_rows(b.grad, sources, q, b.eps, dsources + [dprefix], dw)
    return tuple(_or_empty(t, prefix) for t in (dprefix, dblocks, dw))


def attn_res_mix_list_backward_torch(b: MixListBackwardArgs):
    """``(dsources, dw)``: a list (empty when not asked for) and ``[H]`` (or ``[0]``)."""
    sources = b.sources
    H = sources[0].shape[-1]
    cdt = _compute_dtype(sources[0].dtype)
    q = b.qk_weight.to(cdt)
    if b.norm_weight is not None:
        q = b.norm_weight.to(cdt) * q
    flat = [s.reshape(-1, H) for s in sources]
    dsources = [torch.empty_like(s, memory_format=torch.contiguous_format)
                for s in sources] if b.need_sources else []
    dflat: list[torch.Tensor | None] = [d.view(-1, H) for d in dsources] or [None] * len(sources)
    dw = torch.zeros(q.shape, dtype=cdt, device=q.device) if b.need_weights else None
    mix_backward_rows(b.grad.reshape(-1, H), flat, q, b.eps, dflat, dw)
    return dsources, _or_empty(dw, sources[0])


def _or_empty(t, like):
    return like.new_empty((0,)) if t is None else t


# --------------------------------------------------------------------------- the ops
# Each op's schema is inferred from its record; the kernels take the schema's arguments
# positionally and build the record.


@torch.library.custom_op("kimi::attn_res_mix_backward", mutates_args=(), device_types="cpu")
@record_signature(MixBackwardArgs, returns=tuple[torch.Tensor, torch.Tensor, torch.Tensor])
def attn_res_mix_backward(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``kimi::attn_res_mix``: ``(dprefix, dblocks, d(norm_weight*qk_weight))``."""
    b = MixBackwardArgs(*args)
    validate_mix_backward(b)
    return attn_res_mix_backward_cpu(b)


@attn_res_mix_backward.register_fake
def _attn_res_mix_backward_fake(*args):
    b = MixBackwardArgs(*args)
    validate_mix_backward(b)
    prefix = b.prefix
    empty = prefix.new_empty((0,))
    return (torch.empty_like(prefix) if b.need_prefix else empty,
            torch.empty_like(b.blocks, memory_format=torch.contiguous_format)
            if b.need_blocks else empty.clone(),
            prefix.new_empty(prefix.shape[-1:], dtype=torch.float32)
            if b.need_weights else empty.clone())


@attn_res_mix_backward.register_kernel("cuda")
def _attn_res_mix_backward_cuda(*args):
    from .triton_backward import attn_res_mix_backward_triton

    return attn_res_mix_backward_triton(*args)


@torch.library.custom_op("kimi::attn_res_mix_list_backward", mutates_args=(),
                         device_types=("cpu", "cuda"))
@record_signature(MixListBackwardArgs, returns=tuple[list[torch.Tensor], torch.Tensor])
def attn_res_mix_list_backward(*args) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Backward of ``kimi::attn_res_mix_list``: ``(dsources, d(norm_weight*qk_weight))``.

    Per-source torch ops on any device (the forward is too); ``dsources`` is empty when
    ``need_sources`` is false, ``dw`` ``[0]`` when ``need_weights`` is false.
    """
    b = MixListBackwardArgs(*args)
    validate_mix_list_backward(b)
    return attn_res_mix_list_backward_torch(b)


@attn_res_mix_list_backward.register_fake
def _attn_res_mix_list_backward_fake(*args):
    b = MixListBackwardArgs(*args)
    validate_mix_list_backward(b)
    first = b.sources[0]
    dsources = [torch.empty_like(s, memory_format=torch.contiguous_format)
                for s in b.sources] if b.need_sources else []
    dw = first.new_empty(first.shape[-1:], dtype=torch.float32) if b.need_weights else (
        first.new_empty((0,)))
    return dsources, dw


# --------------------------------------------------------------------------- autograd


def split_weight_grad(dw, norm_weight, qk_weight, need_norm, need_qk):
    """``(d norm_weight, d qk_weight)`` from ``dw = dL/d(norm_weight * qk_weight)``."""
    dnw = dqk = None
    if need_norm:
        dnw = (dw * qk_weight.to(dw.dtype)).to(norm_weight.dtype)
    if need_qk:
        dqk = dw if norm_weight is None else dw * norm_weight.to(dw.dtype)
        dqk = dqk.to(qk_weight.dtype)
    return dnw, dqk


def _in_order(record, grads: dict, n: int | None = None) -> tuple:
    """The gradients of the arguments of ``record``'s op (the first ``n``), from ``grads``
    (by argument name; None for the others)."""
    return tuple(grads.get(name) for name in record._fields[:n])


def _mix_setup(ctx, inputs, output):
    a = MixArgs(*inputs)
    ctx.save_for_backward(*a.tensors)
    ctx.others = a[len(a.tensors):]  # the fields after the tensors


def _mix_backward(ctx, grad):
    a = MixArgs(*ctx.saved_tensors, *ctx.others)
    need = dict(zip(MixArgs._fields, ctx.needs_input_grad, strict=False))
    need_nw, need_qk = need["norm_weight"], need["qk_weight"]
    dprefix, dblocks, dw = torch.ops.kimi.attn_res_mix_backward(*MixBackwardArgs.of(
        grad, a, need_prefix=need["prefix"], need_blocks=need["blocks"],
        need_weights=need_nw or need_qk))
    dnw, dqk = split_weight_grad(dw, a.norm_weight, a.qk_weight, need_nw, need_qk)
    return _in_order(MixArgs, {"prefix": dprefix if need["prefix"] else None,
                               "blocks": dblocks if need["blocks"] else None,
                               "norm_weight": dnw, "qk_weight": dqk})


def _mix_list_setup(ctx, inputs, output):
    a = MixListArgs(*inputs)
    # The dispatcher drops a trailing argument equal to its default (out_dtype=None) from
    # what autograd sees, while setup_context gets it filled back: return that many grads.
    ctx.n_inputs = len(a) - (a.out_dtype is None)
    ctx.n = len(a.sources)
    ctx.need_sources = any(s.requires_grad for s in a.sources)
    ctx.need_nw = a.norm_weight is not None and a.norm_weight.requires_grad
    ctx.need_qk = a.qk_weight.requires_grad
    # The sources one by one, then the other tensor fields (a None is saved as None).
    ctx.save_for_backward(*a.sources, *a.tensors[1:])
    ctx.others = a[len(a.tensors):]  # the fields after the tensors


def _mix_list_backward(ctx, grad):
    saved = ctx.saved_tensors
    a = MixListArgs(list(saved[:ctx.n]), *saved[ctx.n:], *ctx.others)
    dsources, dw = torch.ops.kimi.attn_res_mix_list_backward(*MixListBackwardArgs.of(
        grad, a, need_sources=ctx.need_sources, need_weights=ctx.need_nw or ctx.need_qk))
    dnw, dqk = split_weight_grad(dw, a.norm_weight, a.qk_weight, ctx.need_nw, ctx.need_qk)
    return _in_order(MixListArgs, {"sources": dsources if ctx.need_sources else [None] * ctx.n,
                                   "norm_weight": dnw, "qk_weight": dqk}, ctx.n_inputs)


class _MixFunction(torch.autograd.Function):
    """``attn_res_mix``'s autograd, what ``torch.library.register_autograd`` would build
    from ``_mix_setup`` / ``_mix_backward``, in a kernel of our own
    (``library.register_autograd_kernel``) so that a call recording no gradient runs the
    CPU kernel with one boxing, not two (``library.below_autograd``). The dispatch keyset
    rides last: ``needs_input_grad`` then lines up with the op's arguments."""

    @staticmethod
    def forward(ctx, *args_and_keyset):
        *args, keyset = args_and_keyset
        out = _library.below_autograd(_MIX, keyset, args)
        _mix_setup(ctx, args, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (*_mix_backward(ctx, grad), None)


_MIX = torch.ops.kimi.attn_res_mix.default
_library.register_autograd_kernel(_MIX, lambda keyset, *args: _MixFunction.apply(*args, keyset))
torch.library.register_autograd("kimi::attn_res_mix_list", _mix_list_backward,
                                setup_context=_mix_list_setup)


# aux_tap is the identity in eager (a marker for the aux-stream pass), so its gradient is
# too; without one, AOTAutograd cannot build the joint graph of a trainable model whose
# taps are outputs.
torch.library.register_autograd("kimi::aux_tap", lambda ctx, grad: (grad, None))
