"""Random plain-torch AttnRes programs for the fusion fuzz (tests/test_fusion_vs_inductor_fuzz.py).

A program is one or two mixing sites over a shared layout; each site is assembled from
drawn choices (how the sources are gathered, how the keys are normalised, how the query
dot, the softmax and the weighted sum are spelled, which casts and temperature) and,
at will, one *near miss*: a change that makes the site something other than an AttnRes
mixture, which the fusion pass must leave alone. The second site reads the first one's
output as a source (as K3's layers do), so a wrong fusion of the first site also shows
in the second.

Layouts (``d`` is the source axis, the hidden axis is last):

- ``tnh``: sources ``[T, H]`` stacked on dim 1, logits ``[T, n]``;
- ``nbth``: sources ``[B, T, H]`` stacked on dim 0, logits ``[n, B, T]``;
- ``bank``: ``cat([bank[:, a:a+k], prefix[:, None]], 1)`` over a ``[T, K, H]`` bank.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

EPS = 1e-6
LAYOUTS = ("tnh", "nbth", "bank")
NORMS = ("rms_norm", "rsqrt_mean", "rsqrt_sumdiv", "div_sqrt")
WEIGHTS = ("none", "before", "after")
DOTS = ("einsum", "matmul", "mul_sum", "linear", "linear_bias")
SOFTMAXES = ("method", "functional_fp32", "exp_max", "exp")
WSUMS = ("einsum", "matmul", "mul_sum", "transposed")
KEY_CASTS = ("none", "fp32", "fp32_round")  # round: normalise in fp32, back to the dtype
# Each near miss makes the site something other than softmax-over-sources of RMSNorm'd
# sources dotted with one query, summing those same raw sources.
MISSES = (
    "per_token_query",   # the query varies along T: not one pseudo-query
    "other_values",      # the weighted sum reads other tensors than the keys' sources
    "softmax_other_axis",  # softmax over T (or B), not over the sources
    "mask",              # -inf on some sources of some tokens
    "logit_bias",        # a per-source bias on the logits
    "layernorm_keys",    # mean-centred keys
    "sum_not_mean",      # rsqrt(sum(x^2)): a different eps and scale than the mixture's
    "partial_hidden",    # RMS over half the hidden axis
    "projected_values",  # the weighted sum reads Linear(H, H)(values)
    "squared_weights",   # p * p in the weighted sum
)

# Near misses that change only the logits: no change at all over a single source.
LOGITS_ONLY = {"per_token_query", "mask", "logit_bias", "layernorm_keys", "sum_not_mean",
               "partial_hidden", "squared_weights"}


@dataclass(frozen=True)
class Site:
    n: int                     # number of sources
    gather: str                # stack | cat (tnh, nbth); bank: always the bank cat
    bank_start: int            # bank layout: the slice bank[:, a:a + n - 1]
    norm: str
    weight: str
    dot: str
    softmax: str
    temperature: float | None  # logits * temperature (None: no scaling)
    key_cast: str
    probs_fp32: bool           # keep the probabilities in fp32 (bf16: a wide mixture)
    wsum: str
    miss: str | None = None

    def describe(self) -> str:
        parts = [f"n={self.n}", self.gather if self.bank_start < 0 else
                 f"bank[{self.bank_start}:{self.bank_start + self.n - 1}]+prefix",
                 f"norm={self.norm}/w={self.weight}", f"dot={self.dot}",
                 f"softmax={self.softmax}", f"wsum={self.wsum}"]
        if self.temperature is not None:
            parts.append(f"temp={self.temperature:g}")
        if self.key_cast != "none":
            parts.append(f"keys={self.key_cast}")
        if self.probs_fp32:
            parts.append("probs=fp32")
        if self.miss:
            parts.append(f"MISS={self.miss}")
        return " ".join(parts)


@dataclass(frozen=True)
class Program:
    layout: str
    dtype: torch.dtype
    T: int
    B: int
    H: int
    sites: tuple[Site, ...]
    seed: int
    bank_slots: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def exact_sites(self) -> int:
        return sum(1 for s in self.sites if s.miss is None)

    def describe(self) -> str:
        head = (f"{self.layout} {str(self.dtype).removeprefix('torch.')} T={self.T} "
                f"B={self.B} H={self.H}" + (f" K={self.bank_slots}" if self.layout == "bank"
                                             else ""))
        return head + " | " + " | ".join(s.describe() for s in self.sites)

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d

    def source_shape(self) -> tuple[int, ...]:
        return (self.B, self.T, self.H) if self.layout == "nbth" else (self.T, self.H)


@st.composite
def programs(draw, miss_rate: float = 0.4):
    """A Program. Hypothesis draws the structure; the spellings come from a seeded
    ``random.Random`` (a late Hypothesis draw collapses to its simplest value, see
    tests/test_taps_fuzz.py's ``k3_cases``), seeded by the structure and a drawn integer."""
    layout = draw(st.sampled_from(LAYOUTS), label="layout")
    n_sites = draw(st.integers(1, 2), label="sites")
    knobs = draw(st.integers(0, 2**32 - 1), label="knobs_seed")
    rng = random.Random(f"{layout}/{n_sites}/{knobs}")
    dtype = torch.bfloat16 if rng.random() < 0.3 else torch.float32
    H = rng.choice((8, 16, 32))
    T = 1 if rng.random() < 0.1 else rng.randint(2, 12)
    B = rng.randint(1, 3) if layout == "nbth" else 1
    K = rng.randint(1, 4) if layout == "bank" else 0
    sites = []
    for i in range(n_sites):
        # Site 0's sources are inputs; site i > 0 mixes inputs and the previous output.
        if layout == "bank":
            start = rng.choice((0, 0, 1)) if K > 1 else 0
            n = 1 + rng.randint(0, K - start)  # bank[:, a:a+k] (k may be 0) + prefix
        else:
            start = -1
            n = rng.randint(1 if i == 0 else 2, 4)
        miss = rng.choice(MISSES) if rng.random() < miss_rate else None
        if miss == "softmax_other_axis" and layout == "bank" or n == 1 and miss in LOGITS_ONLY:
            # bank: T is the only other axis. One source: softmax is 1 whatever the logits.
            miss = "other_values"
        if miss == "softmax_other_axis" and T == 1:  # over one token: p = 1, as n = 1 above
            miss = "projected_values"
        if miss == "per_token_query" and T * B == 1:  # one token: its query is the query
            miss = "projected_values"
        sites.append(Site(
            n=n, gather=rng.choice(("stack", "cat")) if layout != "bank" else "bank",
            bank_start=start, norm=rng.choice(NORMS), weight=rng.choice(WEIGHTS),
            dot=rng.choice(DOTS), softmax=rng.choice(SOFTMAXES),
            temperature=rng.choice((None, None, 0.25, 2.0, H ** -0.5)),
            key_cast=rng.choice(KEY_CASTS), probs_fp32=rng.random() < 0.3,
            wsum=rng.choice(WSUMS), miss=miss))
    return Program(layout, dtype, T, B, H, tuple(sites), seed=rng.randint(0, 2**31 - 1),
                   bank_slots=K)


class SiteModule(nn.Module):
    """One mixing site; its parameters are drawn from ``g``."""

    def __init__(self, p: Program, s: Site, g: torch.Generator):
        super().__init__()
        H, dt = p.H, p.dtype

        def param(*shape, scale=1.0, base=0.0):
            return nn.Parameter((base + scale * torch.randn(*shape, generator=g)).to(dt))

        self.p, self.s = p, s
        self.norm_weight = param(H, scale=0.2, base=1.0)
        # |q| ~ 1 over a unit-RMS key: logits of order 1, the softmax is far from uniform.
        self.query = param(H, scale=1.5 / H ** 0.5)
        self.proj = nn.Linear(H, 1, bias=s.dot == "linear_bias").to(dt)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(1, H, generator=g) * 1.5 / H ** 0.5)
            if self.proj.bias is not None:
                self.proj.bias.fill_(0.3)
        if s.miss == "per_token_query":
            self.token_query = param(*p.source_shape(), scale=1.5 / H ** 0.5)
        if s.miss == "logit_bias":
            self.logit_bias = param(s.n, scale=1.0)
        if s.miss == "projected_values":
            self.vproj = nn.Linear(H, H, bias=False).to(dt)
            with torch.no_grad():
                self.vproj.weight.copy_(torch.randn(H, H, generator=g) / H ** 0.5)

    # -- pieces ------------------------------------------------------------------------

    def _axis(self) -> int:
        return 0 if self.p.layout == "nbth" else 1

    def gather(self, sources, bank, prefix):
        s, d = self.s, self._axis()
        if self.p.layout == "bank":
            a = s.bank_start
            return torch.cat([bank[:, a:a + s.n - 1], prefix.unsqueeze(1)], dim=1)
        if s.gather == "stack":
            return torch.stack(sources, dim=d)
        return torch.cat([x.unsqueeze(d) for x in sources], dim=d)

    def keys(self, values):
        s, H = self.s, self.p.H
        k = values.float() if s.key_cast != "none" else values
        w = self.norm_weight.float() if s.key_cast != "none" else self.norm_weight
        if s.miss == "layernorm_keys":
            out = F.layer_norm(k, (H,), w, None, EPS)
        elif s.norm == "rms_norm" and s.miss not in ("sum_not_mean", "partial_hidden"):
            if s.weight == "after":
                out = F.rms_norm(k, (H,), w, EPS)
            elif s.weight == "before":  # the same math: the weight outside the call
                out = w * F.rms_norm(k, (H,), None, EPS)
            else:
                out = F.rms_norm(k, (H,), None, EPS)
        else:
            if s.miss == "partial_hidden":
                ms = k[..., : H // 2].pow(2).mean(-1, keepdim=True)
            elif s.miss == "sum_not_mean":
                ms = k.pow(2).sum(-1, keepdim=True)
            elif s.norm == "rsqrt_sumdiv":
                ms = (k * k).sum(-1, keepdim=True) / H
            else:
                ms = k.pow(2).mean(-1, keepdim=True)
            kw = k * w if s.weight == "before" else k
            out = kw / torch.sqrt(ms + EPS) if s.norm == "div_sqrt" else kw * torch.rsqrt(ms + EPS)
            if s.weight == "after":
                out = out * w
        return out.to(values.dtype) if s.key_cast == "fp32_round" else out

    def logits(self, keys):
        s = self.s
        q = self.query.to(keys.dtype)
        if s.miss == "per_token_query":
            tq = self.token_query.to(keys.dtype).unsqueeze(self._axis())
            lg = (keys * tq).sum(-1)
        elif s.dot == "einsum":
            lg = torch.einsum("nbth,h->nbt" if self.p.layout == "nbth" else "tnh,h->tn", keys, q)
        elif s.dot == "matmul":
            lg = keys @ q
        elif s.dot == "mul_sum":
            lg = (keys * q).sum(-1)
        else:  # Linear(H, 1), with or without a bias (softmax ignores a shared constant)
            lg = F.linear(keys, self.proj.weight.to(keys.dtype),
                          None if self.proj.bias is None else self.proj.bias.to(keys.dtype))
            lg = lg.squeeze(-1)
        if s.temperature is not None:
            lg = lg * s.temperature
        if s.miss == "logit_bias":
            b = self.logit_bias.to(lg.dtype)
            lg = lg + (b if self.p.layout != "nbth" else b[:, None, None])
        if s.miss == "mask":
            lg = lg.masked_fill(self._mask(lg), float("-inf"))
        return lg

    def _mask(self, lg):
        # Source 0 is never masked (no all -inf row); others on every other token.
        d = self._axis()
        src = torch.arange(lg.shape[d], device=lg.device)
        tok = torch.arange(lg.shape[-1] if d == 0 else lg.shape[0], device=lg.device)
        m = (src[None, :] > 0) & (tok[:, None] % 2 == 0)  # [T, n]
        return m if d == 1 else m.t()[:, None, :].expand(lg.shape)

    def softmax(self, lg):
        s = self.s
        d = self._axis()
        if s.miss == "softmax_other_axis":
            d = -1 if self.p.layout == "nbth" else 0
        if s.softmax == "method":
            p = lg.softmax(d)
        elif s.softmax == "functional_fp32":
            p = F.softmax(lg, d, dtype=torch.float32)
        else:
            e = (lg - lg.amax(d, keepdim=True)).exp() if s.softmax == "exp_max" else lg.exp()
            p = e / e.sum(d, keepdim=True)
        return p.float() if s.probs_fp32 else p.to(self.p.dtype)

    def weighted_sum(self, p, values):
        s, nbth = self.s, self.p.layout == "nbth"
        if s.miss == "squared_weights":
            p = p * p
        if s.miss == "projected_values":
            values = self.vproj(values)
        if p.dtype != values.dtype:  # fp32 probabilities: mix the sources in fp32
            values = values.to(p.dtype)
        if s.wsum == "einsum":
            return torch.einsum("nbt,nbth->bth" if nbth else "tn,tnh->th", p, values)
        if s.wsum == "mul_sum":
            return (p.unsqueeze(-1) * values).sum(0 if nbth else 1)
        if s.wsum == "matmul":
            if nbth:  # [B, T, 1, n] @ [B, T, n, H]
                return (p.permute(1, 2, 0).unsqueeze(-2) @ values.permute(1, 2, 0, 3)).squeeze(-2)
            return (p[:, None] @ values)[:, 0]
        if nbth:  # values^T @ p: [B, T, H, n] @ [B, T, n, 1]
            return (values.permute(1, 2, 3, 0) @ p.permute(1, 2, 0).unsqueeze(-1)).squeeze(-1)
        return (values.transpose(1, 2) @ p.unsqueeze(-1)).squeeze(-1)

    def forward(self, sources, bank=None, prefix=None, other=None):
        values = self.gather(sources, bank, prefix)
        p = self.softmax(self.logits(self.keys(values)))
        if self.s.miss == "other_values":  # the same shape, another last source
            values = self.gather([*sources[:-1], other], bank, other)
        return self.weighted_sum(p, values)


class ProgramModule(nn.Module):
    """The program: site i > 0 reads site i-1's output (cast to the dtype) as a source."""

    def __init__(self, p: Program):
        super().__init__()
        g = torch.Generator().manual_seed(p.seed)
        self.p = p
        self.sites = nn.ModuleList(SiteModule(p, s, g) for s in p.sites)
        self.trace: list | None = None  # eager only: each site's sources, for reference()

    def forward(self, xs: list[torch.Tensor], bank, other):
        outs, prev = [], None
        for site in self.sites:
            if self.p.layout == "bank":
                prefix = xs[0] if prev is None else prev
                out = site([], bank=bank, prefix=prefix, other=other)
                a = site.s.bank_start
                srcs = [*bank[:, a:a + site.s.n - 1].unbind(1), prefix]
            else:
                # After site 0, the sources end at the last input: a one-source site 0
                # returns xs[0] itself, which must not come back as a second source.
                srcs = (list(xs[: site.s.n]) if prev is None
                        else [*xs[len(xs) - site.s.n + 1:], prev])
                out = site(srcs, other=other)
            if self.trace is not None:
                self.trace.append(srcs)
            outs.append(out)
            prev = out.to(self.p.dtype)
        return tuple(outs)


def reference(site: SiteModule, sources: list[torch.Tensor]) -> torch.Tensor:
    """The AttnRes mixture an exact site computes, in fp64, from its drawn parameters."""
    s = site.s
    values = torch.stack([x.double() for x in sources], dim=-2)  # [..., n, H]
    q = site.proj.weight[0] if s.dot.startswith("linear") else site.query
    q = q.double() * (1.0 if s.temperature is None else s.temperature)
    w = None if s.weight == "none" else site.norm_weight.double()
    keys = F.rms_norm(values, values.shape[-1:], w, EPS)
    p = (keys @ q).softmax(-1)
    return (p.unsqueeze(-1) * values).sum(-2)


def program_inputs(p: Program) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """(sources, bank, other) for ``ProgramModule``; ``other`` is the near-miss tensor."""
    g = torch.Generator().manual_seed(p.seed + 1)
    # Hidden states are not zero-mean white noise: an offset per source (LayerNorm keys
    # differ from RMSNorm ones) and a profile along H (half the hidden axis has another RMS).
    profile = torch.linspace(0.25, 2.0, p.H)

    def rnd(*shape):
        x = torch.randn(*shape, generator=g) * profile
        return (x + torch.empty(()).uniform_(-1, 1, generator=g)).to(p.dtype)

    xs = [rnd(*p.source_shape()) for _ in range(4)]
    bank = rnd(p.T, p.bank_slots, p.H) if p.layout == "bank" else None
    return xs, bank, rnd(*p.source_shape())
