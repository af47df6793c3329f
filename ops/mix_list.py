"""``kimi::attn_res_mix_list`` (the mixture of a list of sources) and its backward op.

Their whole registration: checks, kernels (per-source torch ops, CPU and CUDA), fake
kernels, autograd (its backward calls ``kimi::attn_res_mix_list_backward``, whose math is
``backward.py``'s). Arguments: ``MixListArgs`` (``sources, norm_weight, qk_weight, eps,
out_dtype=None``). ``sources`` are ``N >= 1`` tensors of one shape ``[*, H]`` (one dtype,
one device), in mixing order. Per row ``r`` (every index but the last), accumulating in fp32:

    logit_j = <s_j[r], norm_weight * qk_weight> * rsqrt(mean(s_j[r]^2) + eps)
    p = softmax_j(logit_j);   out[r] = sum_j p_j * s_j[r]

i.e. ``attn_res_mix`` (docs/design.md section 3, steps 3-5) with the sources given one by one
instead of as ``blocks[:, :n]`` plus ``prefix``. ``norm_weight=None`` is RMSNorm without
a weight (a ones vector). Weights may be in any floating dtype (math is fp32). The
result has the sources' shape, in ``out_dtype`` (default: the sources' dtype), so a
model that mixes in fp32 from bf16 sources keeps its fp32 mixture.

``AttnResFusionPass`` emits it for mixing written in plain torch over a list of tensors:
the stacked copy of the sources is never made. The kernel reads each source in place
(one pass for the key norm and query dot, one for the weighted sum); low-precision
sources are upcast a chunk of rows at a time.
"""

from __future__ import annotations

import torch

from .attn_res_args import MixListArgs, MixListBackwardArgs, record_signature
from .backward import attn_res_mix_list_backward_torch, split_weight_grad
from .checks import SUPPORTED_DTYPES, check_grad, fail
from .library import below_autograd, register

# Rows per chunk are sized so one chunk's fp32 upcast of all sources is about this many bytes.
_CHUNK_BYTES = 4 << 20


#: Every refusal of the mix-list ops names them first.
_OP = "kimi attn_res_mix_list: "


def validate_mix_list(a: MixListArgs) -> None:
    """Check the sources agree with each other and with the weights; raise naming the culprit."""
    sources, eps, out_dtype = a.sources, a.eps, a.out_dtype
    if len(sources) == 0:
        fail(_OP + "sources is empty; pass at least one [*, H] tensor")
    first = sources[0]
    if first.dim() < 1:
        fail(_OP + "sources[0] is 0-D; each source must be a hidden-state tensor [*, H]")
    if first.dtype not in SUPPORTED_DTYPES:
        fail(f"{_OP}sources[0] dtype {first.dtype} is not supported; use one of "
              f"{[str(d) for d in SUPPORTED_DTYPES]}")
    H = first.shape[-1]
    for j, s in enumerate(sources[1:], start=1):
        if s.shape != first.shape:
            fail(f"{_OP}sources[{j}] has shape {tuple(s.shape)} but sources[0] has "
                  f"{tuple(first.shape)}; every source must have one shape [*, H]")
        if s.dtype != first.dtype:
            fail(f"{_OP}sources[{j}] dtype {s.dtype} differs from sources[0] dtype {first.dtype}; "
                  "cast every source to one dtype")
        if s.device != first.device:
            fail(f"{_OP}sources[{j}] is on {s.device} but sources[0] is on {first.device}; "
                  "move every source to one device")
    for name, w in (("norm_weight", a.norm_weight), ("qk_weight", a.qk_weight)):
        if w is None:
            continue
        if w.dim() != 1 or w.shape[0] != H:
            fail(f"{_OP}{name} must be 1-D [H] with H={H} (the sources' last dim), got shape "
                  f"{tuple(w.shape)}")
        if not w.dtype.is_floating_point:
            fail(f"{_OP}{name} dtype {w.dtype} is not a floating dtype")
        if w.device != first.device:
            fail(f"{_OP}{name} is on {w.device} but the sources are on {first.device}")
    if not eps >= 0.0:
        fail(f"{_OP}eps={eps} must be a non-negative float")
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        fail(f"{_OP}out_dtype {out_dtype} is not supported; use one of "
              f"{[str(d) for d in SUPPORTED_DTYPES]} or None (the sources' dtype)")


def folded_query(norm_weight, qk_weight) -> torch.Tensor:
    """The folded pseudo-query ``norm_weight * qk_weight`` in fp32."""
    q = qk_weight.float()
    return q if norm_weight is None else norm_weight.float() * q


def _mix_rows(rows32: list[torch.Tensor], q: torch.Tensor, eps: float, out32: torch.Tensor):
    """Mix fp32 row blocks ``[R, H]`` (one per source) into ``out32`` ``[R, H]``."""
    H = q.shape[0]
    # Two reads per source for the logits (query dot, key norm), one for the sum; the
    # rest works on [R, N] logits.
    dots = torch.stack([x @ q for x in rows32], dim=-1)
    norms = torch.stack([torch.linalg.vector_norm(x, dim=-1) for x in rows32], dim=-1)
    p = (dots * torch.rsqrt(norms.square_().div_(H).add_(eps))).softmax(-1)  # [R, N]
    torch.mul(rows32[0], p[:, :1], out=out32)
    for j in range(1, len(rows32)):
        out32.addcmul_(rows32[j], p[:, j:j + 1])


def validate_mix_list_backward(b: MixListBackwardArgs) -> None:
    """``kimi::attn_res_mix_list_backward``'s checks: its forward's, and ``grad`` against
    the forward's output."""
    validate_mix_list(b.forward)
    check_grad("attn_res_mix_list_backward", b.grad, b.sources[0])


def mix_list_torch(a: MixListArgs, chunk_rows: bool = True):
    """Per-source torch implementation (any device): no stacked copy of the sources.

    fp32 sources are read in place; lower-precision ones are upcast a chunk of rows at a
    time (``chunk_rows``, meant for CPU caches) or all at once.
    """
    sources = a.sources
    shape, H = sources[0].shape, sources[0].shape[-1]
    flat = [s.reshape(-1, H) for s in sources]  # views for contiguous rows
    R = flat[0].shape[0]
    q = folded_query(a.norm_weight, a.qk_weight)
    out32 = torch.empty((R, H), dtype=torch.float32, device=sources[0].device)
    if sources[0].dtype == torch.float32 or not chunk_rows:
        step = max(R, 1)
    else:
        step = max(1, _CHUNK_BYTES // (len(sources) * H * 4))
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        _mix_rows([x[r0:r1].float() for x in flat], q, a.eps, out32[r0:r1])
    return out32.reshape(shape).to(a.out_dtype or sources[0].dtype)


# --------------------------------------------------------------------------- kernels
# The kernels take the schema's arguments positionally; a trailing ``out_dtype=None`` may be
# left off (the record's default fills it).


@record_signature(MixListArgs, returns=torch.Tensor)
def attn_res_mix_list(*args) -> torch.Tensor:
    a = MixListArgs(*args)
    validate_mix_list(a)
    return mix_list_torch(a)


def _attn_res_mix_list_cuda(*args):
    # Per-source torch ops on the GPU (the Triton kernel reads one bank, not a list):
    # each source is read where it lies, upcast whole; no stacked copy.
    a = MixListArgs(*args)
    validate_mix_list(a)
    return mix_list_torch(a, chunk_rows=False)


def _attn_res_mix_list_fake(*args):
    a = MixListArgs(*args)
    validate_mix_list(a)
    first = a.sources[0]
    return first.new_empty(first.shape, dtype=a.out_dtype or first.dtype)


@record_signature(MixListBackwardArgs, returns=tuple[list[torch.Tensor], torch.Tensor])
def attn_res_mix_list_backward(*args) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-source torch ops on any device (as the forward); ``dsources`` is empty when
    ``need_sources`` is false, ``dw`` ``[0]`` when ``need_weights`` is false."""
    b = MixListBackwardArgs(*args)
    validate_mix_list_backward(b)
    return attn_res_mix_list_backward_torch(b)


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


class _MixListFunction(torch.autograd.Function):
    """``attn_res_mix_list``'s autograd (as ``mix._MixFunction``). autograd sees tensors
    only at the top level of ``apply``'s arguments: the ``n`` sources ride flat, after
    ``n`` and the dispatch keyset, then the op's other arguments."""

    @staticmethod
    def forward(ctx, n, keyset, *flat):
        args = (list(flat[:n]), *flat[n:])
        out = below_autograd(torch.ops.kimi.attn_res_mix_list.default, keyset, args)
        a = MixListArgs(*args)
        ctx.n, ctx.n_flat = n, len(flat)
        # The sources one by one, then the other tensor fields (a None is saved as None).
        ctx.save_for_backward(*a.sources, *a.tensors[1:])
        ctx.others = a[len(a.tensors):]  # the fields after the tensors
        return out

    @staticmethod
    def backward(ctx, grad):
        n, saved = ctx.n, ctx.saved_tensors
        a = MixListArgs(list(saved[:n]), *saved[n:], *ctx.others)
        need = ctx.needs_input_grad[2:]  # those of flat
        need_sources, need_nw, need_qk = any(need[:n]), need[n], need[n + 1]
        dsources, dw = torch.ops.kimi.attn_res_mix_list_backward(*MixListBackwardArgs.of(
            grad, a, need_sources=need_sources, need_weights=need_nw or need_qk))
        dnw, dqk = split_weight_grad(dw, a.norm_weight, a.qk_weight, need_nw, need_qk)
        per_source = list(dsources) if need_sources else [None] * n
        return (None, None, *per_source, dnw, dqk, *[None] * (ctx.n_flat - n - 2))


def _record_mix_list(op, keyset, sources, *others):
    return _MixListFunction.apply(len(sources), keyset, *sources, *others)


attn_res_mix_list = register(attn_res_mix_list, fake=_attn_res_mix_list_fake,
                             cuda=_attn_res_mix_list_cuda, record=_record_mix_list)
attn_res_mix_list_backward = register(
    attn_res_mix_list_backward, fake=_attn_res_mix_list_backward_fake,
    cuda=attn_res_mix_list_backward)
