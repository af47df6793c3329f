"""Argument checks shared by every path of the AttnRes ops (eager, Triton, fake).

The fake kernels run the same checks, so a malformed model fails when it is
compiled, not when it is served.
"""

from __future__ import annotations

import torch

from .attn_res_args import AttnResArgs, AttnResQuantArgs, MixBackwardArgs
from .fp8_quant import FP8_MAX

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AttnResArgumentError(ValueError):
    """An AttnRes op was called with arguments that break its contract."""


def _fail(msg: str) -> None:
    raise AttnResArgumentError(msg)


def _check_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        _fail(
            f"kimi attn_res: {name} must be {rank}-D {layout}, got shape "
            f"{tuple(t.shape)} ({t.dim()}-D)"
        )


def validate_sources(a: AttnResArgs) -> None:
    """Check ranks, shapes, dtypes, devices and index ranges; raise naming the culprit."""
    if not _well_formed(a):
        _diagnose(a)


def _well_formed(a: AttnResArgs) -> bool:
    """Every check of ``_diagnose`` at once, with fewer tensor attribute reads (each is a
    call into C, and every eager call validates; docs/design.md section 9). True only where
    ``_diagnose`` would pass; False sends the call to ``_diagnose``, which names the culprit
    (or passes, where only this shortcut declined: a tensor off the CPU, say)."""
    prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight = a[:6]
    dtype = prefix.dtype
    ps, bs = prefix.shape, blocks.shape
    if dtype not in SUPPORTED_DTYPES or len(ps) != 2 or len(bs) != 3 or not prefix.is_cpu:
        return False
    T, H = ps
    nb_total = bs[1]
    if not (bs[0] == T and bs[2] == H and 0 <= a.num_blocks <= nb_total
            and -1 <= a.block_write_idx < nb_total
            and a.eps >= 0.0 and a.output_norm_eps >= 0.0  # False for NaN, as below
            and blocks.dtype == dtype and blocks.is_cpu):
        return False
    if delta is not None and not (delta.dtype == dtype and delta.is_cpu and delta.shape == ps):
        return False
    for w in (norm_weight, qk_weight, output_norm_weight):
        if w is not None and not (w.dtype == dtype and w.is_cpu and w.shape == (H,)):
            return False
    return True


def _diagnose(a: AttnResArgs) -> None:
    """The checks one by one: raise naming the first that fails."""
    prefix, delta, blocks, output_norm_weight = a.prefix, a.delta, a.blocks, a.output_norm_weight
    _check_rank("prefix", prefix, 2, "[T, H]")
    if delta is not None:
        _check_rank("delta", delta, 2, "[T, H]")
    _check_rank("blocks", blocks, 3, "[T, NB, H]")
    weights = [("norm_weight", a.norm_weight), ("qk_weight", a.qk_weight)]
    if output_norm_weight is not None:
        weights.append(("output_norm_weight", output_norm_weight))
    for name, w in weights:
        _check_rank(name, w, 1, "[H]")

    T, H = prefix.shape
    if prefix.dtype not in SUPPORTED_DTYPES:
        _fail(
            f"kimi attn_res: prefix dtype {prefix.dtype} is not supported; "
            f"use one of {[str(d) for d in SUPPORTED_DTYPES]}"
        )
    others = [("blocks", blocks)] + weights
    if delta is not None:
        others.insert(0, ("delta", delta))
    for name, t in others:
        if t.dtype != prefix.dtype:
            _fail(
                f"kimi attn_res: {name} dtype {t.dtype} differs from prefix dtype "
                f"{prefix.dtype}; cast every tensor to one dtype"
            )
        if t.device != prefix.device:
            _fail(
                f"kimi attn_res: {name} is on {t.device} but prefix is on "
                f"{prefix.device}; move every tensor to one device"
            )
        if t.shape[-1] != H:
            _fail(
                f"kimi attn_res: hidden size mismatch: {name} has H={t.shape[-1]} "
                f"(shape {tuple(t.shape)}) but prefix has H={H}"
            )
    for name, part in (("delta", delta), ("blocks", blocks)):
        if part is not None and part.shape[0] != T:
            _fail(
                f"kimi attn_res: token count mismatch: {name} has T={part.shape[0]} "
                f"(shape {tuple(part.shape)}) but prefix has T={T}"
            )
    nb_total = blocks.shape[1]
    num_blocks, block_write_idx = a.num_blocks, a.block_write_idx
    if not 0 <= num_blocks <= nb_total:
        _fail(
            f"kimi attn_res: num_blocks={num_blocks} is outside [0, {nb_total}] "
            f"(blocks has NB={nb_total} slots)"
        )
    if not -1 <= block_write_idx < nb_total:
        _fail(
            f"kimi attn_res: block_write_idx={block_write_idx} is outside "
            f"[-1, {nb_total}) (blocks has NB={nb_total} slots; -1 means no write)"
        )
    for name, value in (("eps", a.eps), ("output_norm_eps", a.output_norm_eps)):
        if not value >= 0.0:
            _fail(f"kimi attn_res: {name}={value} must be a non-negative float")


def validate_quant(q: AttnResQuantArgs) -> None:
    """``kimi::attn_res_quant``'s checks: the mixture's (``validate_sources``), then the
    quant's fields; raise naming the culprit and what to pass."""
    validate_sources(q.base)
    if q.quant_dtype not in FP8_MAX:
        _fail(f"kimi attn_res_quant: quant_dtype {q.quant_dtype} is not supported; use one of "
              f"{[str(d) for d in FP8_MAX]}")
    fp8_max = torch.finfo(q.quant_dtype).max
    if not 0.0 <= q.quant_max <= fp8_max:  # False for NaN
        _fail(f"kimi attn_res_quant: quant_max={q.quant_max} is outside [0, {fp8_max}] (the "
              f"largest {q.quant_dtype}); pass 0 for vLLM's bound "
              f"({FP8_MAX[q.quant_dtype]} for {q.quant_dtype})")
    for name, value in (("amax_floor", q.amax_floor), ("scale_floor", q.scale_floor)):
        if not 0.0 <= value < float("inf"):
            _fail(f"kimi attn_res_quant: {name}={value} must be a finite non-negative float")
    ub = q.scale_ub
    if ub is not None and (ub.numel() != 1 or ub.dtype != torch.float32
                           or ub.device != q.prefix.device):
        _fail(f"kimi attn_res_quant: scale_ub must be a one-element float32 tensor on "
              f"{q.prefix.device} (vLLM's QuantFP8 scale_ub), got shape {tuple(ub.shape)}, "
              f"{ub.dtype} on {ub.device}")


def validate_mix_backward(b: MixBackwardArgs) -> None:
    """``kimi::attn_res_mix_backward``'s checks: its forward's (``validate_sources``), and
    ``grad`` against the forward's output."""
    validate_sources(AttnResArgs.mix(*b.forward))
    check_grad("attn_res_mix_backward", b.grad, b.prefix)


def validate_tap(x: torch.Tensor, capture_id: int) -> None:
    if isinstance(capture_id, bool) or not isinstance(capture_id, int) or capture_id < 0:
        raise AttnResArgumentError(
            f"kimi aux_tap: capture_id must be a non-negative int (vLLM capture id: "
            f"what layer k reads), got {capture_id!r}"
        )
    if x.dim() < 1:
        raise AttnResArgumentError(
            "kimi aux_tap: x must be a hidden-state tensor [..., H], got a 0-D tensor"
        )


def check_grad(op: str, grad, like) -> None:
    """``grad`` (dL/d(output) of op ``op``) must match the forward output ``like``."""
    if grad.shape != like.shape or grad.device != like.device:
        raise AttnResArgumentError(
            f"kimi {op}: grad has shape {tuple(grad.shape)} on {grad.device} but the forward "
            f"output has shape {tuple(like.shape)} on {like.device}; pass dL/d(output)")
    if grad.dtype not in SUPPORTED_DTYPES:
        raise AttnResArgumentError(
            f"kimi {op}: grad dtype {grad.dtype} is not one of float32, bfloat16, float16")
