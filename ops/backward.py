"""The backward math of the AttnRes mixture: the CPU kernels of ``kimi::attn_res_mix_backward``
(``mix.py``) and ``kimi::attn_res_mix_list_backward`` (``mix_list.py``, any device).

Per row, with sources ``v_j`` (``j < n``), folded query ``w = norm_weight * qk_weight``:

    r_j = rsqrt(mean(v_j^2) + eps);  logit_j = <v_j, w> * r_j;  p = softmax(logit)
    out = sum_j p_j v_j

Given ``g = dL/dout``:

    dlogit_j = p_j * (<g, v_j> - <g, out>)          (<g, out> = sum_k p_k <g, v_k>)
    a_j      = dlogit_j * r_j                         (gradient of the dot <v_j, w>)
    dv_j     = p_j g + a_j w - (a_j * logit_j * r_j / H) v_j
    dw       = sum over rows and sources of a_j v_j
    d(norm_weight) = dw * qk_weight;  d(qk_weight) = dw * norm_weight

(the last term of ``dv_j`` is the key-norm path: ``dr_j/dv_j = -r_j^3 v_j / H``). Nothing
is saved by the forward beyond its inputs: the backward recomputes the ``[n]`` logits of
a row from the sources, which it reads for ``<g, v_j>`` anyway. A chunk of rows of all
sources is staged in one cache-sized buffer and both passes run on it, each ``dv_j``
written straight into its destination. Accumulation is fp32 (fp64 for fp64 inputs, which
only the tests' gradcheck passes); gradients are rounded to each input's dtype once.
"""

from __future__ import annotations

import torch

from .attn_res_args import MixBackwardArgs, MixListBackwardArgs

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


def split_weight_grad(dw, norm_weight, qk_weight, need_norm, need_qk):
    """``(d norm_weight, d qk_weight)`` from ``dw = dL/d(norm_weight * qk_weight)``."""
    dnw = dqk = None
    if need_norm:
        dnw = (dw * qk_weight.to(dw.dtype)).to(norm_weight.dtype)
    if need_qk:
        dqk = dw if norm_weight is None else dw * norm_weight.to(dw.dtype)
        dqk = dqk.to(qk_weight.dtype)
    return dnw, dqk
