"""CPU path of the AttnRes ops: reads each source once, no copy of the bank.

The plain-torch statement concatenates the sources (a full copy of the bank) and
then runs RMSNorm, two matmuls and a softmax over that copy, each pass over memory
allocating a bank-sized temporary. Here the rows are processed a chunk at a time:
the chunk's sources (``blocks[t0:t1, :num_blocks]`` and the prefix rows, after the
in-place delta add and block write) are upcast into one small fp32 staging buffer
that stays in cache, and every later pass (query dots, key norms, softmax, weighted
sum, output norm) reads that buffer, not memory. All scratch space is allocated
once per call and reused through ``out=`` variants: fresh multi-MB allocations
cost page faults on every call. Accumulation is fp32 throughout; the outputs are
rounded to the input dtype once.

Small calls (decode sizes) run in C instead (``cpu_native.py``): there the dozen ATen
calls below cost more than the arithmetic.
"""

from __future__ import annotations

import torch

from . import cpu_native
from .attn_res_args import AttnResArgs, AttnResQuantArgs
from .fp8_quant import quantize_rows

# Rows per chunk are sized so the chunk's fp32 staging buffer is about this many bytes.
_CHUNK_BYTES = 8 << 20


def _chunk_rows(T: int, n_src: int, H: int) -> int:
    """Rows per chunk: at most ``_CHUNK_BYTES`` of fp32 staging, chunks of equal size."""
    rows = max(1, min(T, _CHUNK_BYTES // (n_src * H * 4)))
    n_chunks = max(1, -(-T // rows))
    return max(1, -(-T // n_chunks))


def _attn_res_rows(a: AttnResArgs, out, mixed):
    """Fill ``out`` (and ``mixed``, the pre-norm mixture, when not None): in C where
    ``cpu_native.serves`` the call, else chunk by chunk with torch."""
    if not (cpu_native.serves(a, 1 if mixed is None else 2)
            and cpu_native.attn_res_rows(a, out, mixed)):
        torch_rows(a, out, mixed)


def torch_rows(a: AttnResArgs, out, mixed):
    """The torch path of ``_attn_res_rows``."""
    prefix, delta, blocks, output_norm_weight = a.prefix, a.delta, a.blocks, a.output_norm_weight
    block_write_idx, eps = a.block_write_idx, a.eps
    T, H = prefix.shape
    nb, n = a.num_blocks, a.num_blocks + 1
    f32, dev = torch.float32, prefix.device
    rows = _chunk_rows(T, n, H)
    direct = prefix.dtype == f32 and output_norm_weight is None  # mixture lands in ``out``
    if nb:
        w = a.norm_weight.to(f32) * a.qk_weight.to(f32)
        stage = torch.empty((rows, n, H), dtype=f32, device=dev)
        logits = torch.empty((rows, n), dtype=f32, device=dev)
        inv = torch.empty((rows, n), dtype=f32, device=dev)
    onw = None if output_norm_weight is None else output_norm_weight.to(f32)
    mix_buf = None if direct else torch.empty((rows, H), dtype=f32, device=dev)
    scale = torch.empty((rows, 1), dtype=f32, device=dev)
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        C = t1 - t0
        x = prefix[t0:t1]
        if delta is not None:
            x.add_(delta[t0:t1])  # low precision: fp32 add, one rounding (as the reference)
        if block_write_idx >= 0:
            blocks[t0:t1, block_write_idx].copy_(x)
        m = out[t0:t1] if direct else mix_buf[:C]  # type: ignore[index]  # None only if direct
        if nb == 0:
            m.copy_(x)  # a single source gets softmax weight 1
        else:
            v = stage[:C]
            torch.cat((blocks[t0:t1, :nb], x.unsqueeze(1)), dim=1, out=v)  # chunk-sized stage
            lg, r = logits[:C], inv[:C]
            torch.mv(v.view(C * n, H), w, out=lg.view(C * n))
            torch.linalg.vector_norm(v, dim=-1, out=r)
            lg.mul_(r.square_().div_(H).add_(eps).rsqrt_())
            p = torch.softmax(lg, dim=-1)
            torch.bmm(p.unsqueeze(1), v, out=m.unsqueeze(1))
        if direct:
            continue
        if mixed is not None:
            mixed[t0:t1].copy_(m)
        if onw is None:
            out[t0:t1].copy_(m)
            continue
        s = scale[:C]
        torch.linalg.vector_norm(m, dim=-1, keepdim=True, out=s)
        s.square_().div_(H).add_(a.output_norm_eps).rsqrt_()
        torch.mul(m.mul_(s), onw, out=out[t0:t1])  # rounds to the output dtype once


def mix_cpu(a: AttnResArgs) -> torch.Tensor:
    """Pre-norm mixture of ``blocks[:, :num_blocks]`` then ``prefix`` (``a`` is the pure
    mixture form, ``AttnResArgs.mix``), a new ``prefix.dtype`` tensor (fp32 accumulation)."""
    out = torch.empty_like(a.prefix)  # the fake kernel's layout; cheaper than empty(shape)
    _attn_res_rows(a, out, None)
    return out


def attn_res_cpu(a: AttnResArgs, *, capture: bool = True):
    """Returns ``(out, mixed)``; mutates prefix (delta) and blocks (write) in place.

    ``mixed`` is ``out`` itself when there is no output norm, and None when the
    caller does not capture (``capture=False``) and there is an output norm.
    """
    out = torch.empty_like(a.prefix)
    mixed = None
    if capture and a.output_norm_weight is not None:
        mixed = torch.empty_like(out)
    _attn_res_rows(a, out, mixed)
    return out, (out if a.output_norm_weight is None else mixed)


def attn_res_quant_cpu(q: AttnResQuantArgs, *, capture: bool):
    """``kimi::attn_res_quant`` (``capture``: ``attn_res_quant_capture``): the output of
    ``attn_res_cpu`` (in the sources' dtype) quantized per row (``fp8_quant.quantize_rows``).
    Returns ``(data, scale)``, and the pre-norm mixture when ``capture``; mutates prefix
    (delta) and blocks (write) in place."""
    out, mixed = attn_res_cpu(q.base, capture=capture)
    data, scale = quantize_rows(out, q)
    return (data, scale, mixed) if capture else (data, scale)
