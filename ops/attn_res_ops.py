"""``kimi::attn_res``, ``attn_res_capture``, ``attn_res_quant``, ``attn_res_quant_capture``.

Their whole registration: the checks (``validate_sources``, ``validate_quant``), the CPU
kernels (``cpu.py``), the CUDA kernels (the Triton launches of ``triton_kernels.py``,
also public as ``kimi_passes.ops.attn_res_triton`` etc.), the fake kernels and the
Autograd kernel (``library.register``). Semantics: docs/design.md section 3.

- ``attn_res``: mutates ``prefix`` (``+= delta``) and ``blocks`` (slot
  ``block_write_idx``), returns the (output-normed) mixture;
- ``attn_res_capture``: the same, also returning the pre-norm mixture (the aux-stream
  pass swaps a tap's consumer to it, so a tap costs one ``[T, H]`` write);
- ``attn_res_quant`` / ``attn_res_quant_capture``: the output quantized per token to
  FP8 (``fp8_quant.py``): ``(data, scale[, mixed])``.

Arguments: ``AttnResArgs`` / ``AttnResQuantArgs`` (``attn_res_args.py``). The ops mutate
their inputs, and torch has no autograd for such an op: a backward through one raises,
naming ``attn_res_differentiable`` (``differentiable.py``).
"""

from __future__ import annotations

import torch

from .attn_res_args import AttnResArgs, AttnResQuantArgs, record_signature
from .checks import SUPPORTED_DTYPES, fail
from .conventions import MUTATED_ARGS
from .cpu import attn_res_cpu, attn_res_quant_cpu
from .fp8_quant import FP8_MAX, quantize_rows
from .library import below_autograd, no_formula, register

# --------------------------------------------------------------------------- checks


def _check_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        fail(
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
        fail(
            f"kimi attn_res: prefix dtype {prefix.dtype} is not supported; "
            f"use one of {[str(d) for d in SUPPORTED_DTYPES]}"
        )
    others = [("blocks", blocks)] + weights
    if delta is not None:
        others.insert(0, ("delta", delta))
    for name, t in others:
        if t.dtype != prefix.dtype:
            fail(
                f"kimi attn_res: {name} dtype {t.dtype} differs from prefix dtype "
                f"{prefix.dtype}; cast every tensor to one dtype"
            )
        if t.device != prefix.device:
            fail(
                f"kimi attn_res: {name} is on {t.device} but prefix is on "
                f"{prefix.device}; move every tensor to one device"
            )
        if t.shape[-1] != H:
            fail(
                f"kimi attn_res: hidden size mismatch: {name} has H={t.shape[-1]} "
                f"(shape {tuple(t.shape)}) but prefix has H={H}"
            )
    for name, part in (("delta", delta), ("blocks", blocks)):
        if part is not None and part.shape[0] != T:
            fail(
                f"kimi attn_res: token count mismatch: {name} has T={part.shape[0]} "
                f"(shape {tuple(part.shape)}) but prefix has T={T}"
            )
    nb_total = blocks.shape[1]
    num_blocks, block_write_idx = a.num_blocks, a.block_write_idx
    if not 0 <= num_blocks <= nb_total:
        fail(
            f"kimi attn_res: num_blocks={num_blocks} is outside [0, {nb_total}] "
            f"(blocks has NB={nb_total} slots)"
        )
    if not -1 <= block_write_idx < nb_total:
        fail(
            f"kimi attn_res: block_write_idx={block_write_idx} is outside "
            f"[-1, {nb_total}) (blocks has NB={nb_total} slots; -1 means no write)"
        )
    for name, value in (("eps", a.eps), ("output_norm_eps", a.output_norm_eps)):
        if not value >= 0.0:
            fail(f"kimi attn_res: {name}={value} must be a non-negative float")


def validate_quant(q: AttnResQuantArgs) -> None:
    """``kimi::attn_res_quant``'s checks: the mixture's (``validate_sources``), then the
    quant's fields; raise naming the culprit and what to pass."""
    validate_sources(q.base)
    if q.quant_dtype not in FP8_MAX:
        fail(f"kimi attn_res_quant: quant_dtype {q.quant_dtype} is not supported; use one of "
              f"{[str(d) for d in FP8_MAX]}")
    fp8_max = torch.finfo(q.quant_dtype).max
    if not 0.0 <= q.quant_max <= fp8_max:  # False for NaN
        fail(f"kimi attn_res_quant: quant_max={q.quant_max} is outside [0, {fp8_max}] (the "
              f"largest {q.quant_dtype}); pass 0 for vLLM's bound "
              f"({FP8_MAX[q.quant_dtype]} for {q.quant_dtype})")
    for name, value in (("amax_floor", q.amax_floor), ("scale_floor", q.scale_floor)):
        if not 0.0 <= value < float("inf"):
            fail(f"kimi attn_res_quant: {name}={value} must be a finite non-negative float")
    ub = q.scale_ub
    if ub is not None and (ub.numel() != 1 or ub.dtype != torch.float32
                           or ub.device != q.base.prefix.device):
        fail(f"kimi attn_res_quant: scale_ub must be a one-element float32 tensor on "
              f"{q.base.prefix.device} (vLLM's QuantFP8 scale_ub), got shape {tuple(ub.shape)}, "
              f"{ub.dtype} on {ub.device}")


# --------------------------------------------------------------------------- CUDA (Triton)
# The Triton launches take the op's arguments as the op does (positional or by name), and
# ``route`` (``triton_kernels.triton_route``) by keyword; triton is imported at the first
# launch (it is Linux-only). On CPU tensors they need TRITON_INTERPRET=1.


def new_like_prefix(a: AttnResArgs) -> torch.Tensor:
    """A new contiguous ``[T, H]`` buffer of ``prefix``'s dtype and device (an output)."""
    return torch.empty(a.prefix.shape, dtype=a.prefix.dtype, device=a.prefix.device)


def attn_res_triton(*args, route: str | None = None, **kwargs) -> torch.Tensor:
    """``kimi::attn_res`` on the tensors' device; mutates ``prefix`` and ``blocks``."""
    from .triton_kernels import launch

    a = AttnResArgs(*args, **kwargs)
    validate_sources(a)
    out = new_like_prefix(a)
    launch(a, out, None, route)
    return out


def attn_res_capture_triton(*args, route: str | None = None,
                            **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``kimi::attn_res_capture``: ``(out, mixed)``, two distinct buffers."""
    from .triton_kernels import launch

    a = AttnResArgs(*args, **kwargs)
    validate_sources(a)
    out, mixed = new_like_prefix(a), new_like_prefix(a)
    launch(a, out, mixed, route)
    return out, mixed


def _quant_triton(q: AttnResQuantArgs, route: str | None, capture: bool):
    from .triton_kernels import launch
    from .triton_quant import QuantOut

    validate_quant(q)
    a = q.base
    quant = QuantOut(q, *_quant_outputs(q))
    mixed = new_like_prefix(a) if capture else None
    launch(a, None, mixed, route, quant)
    if a.prefix.shape[1] == 0:  # no launch: the scales of empty rows (the floors)
        quant.scale.copy_(quantize_rows(a.prefix, q)[1])
    return (quant.data, quant.scale, mixed) if capture else (quant.data, quant.scale)


def attn_res_quant_triton(*args, route: str | None = None,
                          **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``kimi::attn_res_quant``: ``(data, scale)``; mutates ``prefix`` and ``blocks``."""
    return _quant_triton(AttnResQuantArgs.from_args(*args, **kwargs), route, capture=False)


def attn_res_quant_capture_triton(*args, route: str | None = None,
                                  **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kimi::attn_res_quant_capture``: ``(data, scale, mixed)``."""
    return _quant_triton(AttnResQuantArgs.from_args(*args, **kwargs), route, capture=True)


# --------------------------------------------------------------------------- CPU and fake
# The dispatcher hands kernels the schema's arguments positionally: ``*args`` is the
# record in schema order.


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


@record_signature(AttnResQuantArgs, returns=tuple[torch.Tensor, torch.Tensor])
def attn_res_quant(*args) -> tuple[torch.Tensor, torch.Tensor]:
    q = AttnResQuantArgs.from_args(*args)
    validate_quant(q)
    return attn_res_quant_cpu(q, capture=False)


@record_signature(AttnResQuantArgs, returns=tuple[torch.Tensor, torch.Tensor, torch.Tensor])
def attn_res_quant_capture(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = AttnResQuantArgs.from_args(*args)
    validate_quant(q)
    return attn_res_quant_cpu(q, capture=True)


def _attn_res_fake(*args):
    a = AttnResArgs(*args)
    validate_sources(a)
    return torch.empty_like(a.prefix)


def _attn_res_capture_fake(*args):
    a = AttnResArgs(*args)
    validate_sources(a)
    return torch.empty_like(a.prefix), torch.empty_like(a.prefix)


def _quant_outputs(q: AttnResQuantArgs):
    """The quant ops' new outputs, as every path allocates them: contiguous ``data`` in the
    fp8 dtype, fp32 ``scale`` ``[T, 1]``."""
    T, H = q.base.prefix.shape
    dev = q.base.prefix.device
    return (torch.empty((T, H), dtype=q.quant_dtype, device=dev),
            torch.empty((T, 1), dtype=torch.float32, device=dev))


def _attn_res_quant_fake(*args):
    q = AttnResQuantArgs.from_args(*args)
    validate_quant(q)
    return _quant_outputs(q)


def _attn_res_quant_capture_fake(*args):
    q = AttnResQuantArgs.from_args(*args)
    validate_quant(q)
    return (*_quant_outputs(q), torch.empty_like(q.base.prefix))


# --------------------------------------------------------------------------- autograd
# The flat argument positions of the mutated tensors: the same in both records (the
# quant's flat list starts with AttnResArgs' fields).
_MUTATED_IDX = tuple(AttnResArgs._fields.index(name) for name in MUTATED_ARGS)


def _mutate_below_autograd(op, keyset, args):
    # What custom_op's version-bump kernel does, in the same Python frame as the autograd
    # check: autograd sees prefix and blocks change (a saved copy of either fails loudly).
    for i in _MUTATED_IDX:
        torch.autograd.graph.increment_version(args[i])
    return below_autograd(op, keyset, args)


def _register(fn, fake, cuda):
    why = (f"Trying to backward through kimi.{fn.__name__}.default but no autograd formula exists: "
           f"it mutates {' and '.join(MUTATED_ARGS)}, and torch has no autograd for an op "
           f"that mutates its inputs. Train through kimi_passes.ops.attn_res_differentiable "
           f"/ attn_res_capture_differentiable (same arguments, same effects).")
    return register(fn, fake=fake, cuda=cuda, mutates_args=MUTATED_ARGS,
                    record=no_formula(why, _mutate_below_autograd), run=_mutate_below_autograd)


attn_res = _register(attn_res, _attn_res_fake, attn_res_triton)
attn_res_capture = _register(attn_res_capture, _attn_res_capture_fake, attn_res_capture_triton)
attn_res_quant = _register(attn_res_quant, _attn_res_quant_fake, attn_res_quant_triton)
attn_res_quant_capture = _register(attn_res_quant_capture, _attn_res_quant_capture_fake,
                                   attn_res_quant_capture_triton)
