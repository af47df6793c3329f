"""``kimi::attn_res_mix_list``: the pre-norm AttnRes mixture of a list of sources.

    attn_res_mix_list(Tensor[] sources, Tensor? norm_weight, Tensor qk_weight, float eps,
                      ScalarType? out_dtype=None) -> Tensor

(inferred from the record ``MixListArgs``, ``ops/attn_res_args.py``, which the kernels, the
checks and ``mix_list_torch`` take).

``sources`` are ``N >= 1`` tensors of one shape ``[*, H]`` (one dtype, one device), in
mixing order. Per row ``r`` (every index but the last), accumulating in fp32:

    logit_j = <s_j[r], norm_weight * qk_weight> * rsqrt(mean(s_j[r]^2) + eps)
    p = softmax_j(logit_j);   out[r] = sum_j p_j * s_j[r]

i.e. ``attn_res_mix`` (docs/design.md section 3, steps 3-5) with the sources given one by one
instead of as ``blocks[:, :n]`` plus ``prefix``. ``norm_weight=None`` is RMSNorm without
a weight (a ones vector). Weights may be in any floating dtype (math is fp32). The
result has the sources' shape, in ``out_dtype`` (default: the sources' dtype), so a
model that mixes in fp32 from bf16 sources keeps its fp32 mixture.

This is what ``AttnResFusionPass`` emits for mixing written in plain torch over a
python list of tensors (``torch.stack`` / ``torch.cat`` of them): the stacked copy of
the sources is never made. The kernel reads each source in place with per-source
reductions (one pass for the key norm and query dot, one for the weighted sum);
low-precision sources are upcast a chunk of rows at a time.
"""

from __future__ import annotations

import torch

from .attn_res_args import MixListArgs, MixListBackwardArgs, record_signature
from .validate import SUPPORTED_DTYPES, AttnResArgumentError, check_grad

# Rows per chunk are sized so one chunk's fp32 upcast of all sources is about this many bytes.
_CHUNK_BYTES = 4 << 20


def _fail(msg: str) -> None:
    raise AttnResArgumentError(f"kimi attn_res_mix_list: {msg}")


def validate_mix_list(a: MixListArgs) -> None:
    """Check the sources agree with each other and with the weights; raise naming the culprit."""
    sources, eps, out_dtype = a.sources, a.eps, a.out_dtype
    if len(sources) == 0:
        _fail("sources is empty; pass at least one [*, H] tensor")
    first = sources[0]
    if first.dim() < 1:
        _fail("sources[0] is 0-D; each source must be a hidden-state tensor [*, H]")
    if first.dtype not in SUPPORTED_DTYPES:
        _fail(f"sources[0] dtype {first.dtype} is not supported; use one of "
              f"{[str(d) for d in SUPPORTED_DTYPES]}")
    H = first.shape[-1]
    for j, s in enumerate(sources[1:], start=1):
        if s.shape != first.shape:
            _fail(f"sources[{j}] has shape {tuple(s.shape)} but sources[0] has "
                  f"{tuple(first.shape)}; every source must have one shape [*, H]")
        if s.dtype != first.dtype:
            _fail(f"sources[{j}] dtype {s.dtype} differs from sources[0] dtype {first.dtype}; "
                  "cast every source to one dtype")
        if s.device != first.device:
            _fail(f"sources[{j}] is on {s.device} but sources[0] is on {first.device}; "
                  "move every source to one device")
    for name, w in (("norm_weight", a.norm_weight), ("qk_weight", a.qk_weight)):
        if w is None:
            continue
        if w.dim() != 1 or w.shape[0] != H:
            _fail(f"{name} must be 1-D [H] with H={H} (the sources' last dim), got shape "
                  f"{tuple(w.shape)}")
        if not w.dtype.is_floating_point:
            _fail(f"{name} dtype {w.dtype} is not a floating dtype")
        if w.device != first.device:
            _fail(f"{name} is on {w.device} but the sources are on {first.device}")
    if not eps >= 0.0:
        _fail(f"eps={eps} must be a non-negative float")
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        _fail(f"out_dtype {out_dtype} is not supported; use one of "
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


# The kernels take the schema's arguments positionally; a trailing ``out_dtype=None`` may be
# left off (the record's default fills it).


@torch.library.custom_op("kimi::attn_res_mix_list", mutates_args=(), device_types="cpu")
@record_signature(MixListArgs, returns=torch.Tensor)
def attn_res_mix_list(*args) -> torch.Tensor:
    a = MixListArgs(*args)
    validate_mix_list(a)
    return mix_list_torch(a)


@attn_res_mix_list.register_fake
def _attn_res_mix_list_fake(*args):
    a = MixListArgs(*args)
    validate_mix_list(a)
    first = a.sources[0]
    return first.new_empty(first.shape, dtype=a.out_dtype or first.dtype)


@attn_res_mix_list.register_kernel("cuda")
def _attn_res_mix_list_cuda(*args):
    # Per-source torch ops on the GPU (the Triton kernel reads one bank, not a list):
    # each source is read where it lies, upcast whole; no stacked copy.
    a = MixListArgs(*args)
    validate_mix_list(a)
    return mix_list_torch(a, chunk_rows=False)
