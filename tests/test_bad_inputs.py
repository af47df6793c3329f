"""Bad inputs are refused loudly, with the exception type the user sees and a message that
names what is wrong. Table-driven: each row is (name, callable, exception type, regex).

The type is checked exactly (``type(e) is exc``), so a refusal that reaches the user
wrapped in a Dynamo/Inductor exception fails its row instead of passing as a subclass.

- every rule of the ops' checks (``ops/attn_res_ops.py``, ``ops/aux_tap.py``), for
  ``kimi.attn_res``, ``attn_res_capture`` and ``attn_res_mix``, eagerly and under
  ``FakeTensorMode`` (the fake kernels run the same checks, so a malformed model fails
  when it is compiled), plus what ``torch.compile`` shows for one (Dynamo's
  ``TorchRuntimeError`` quoting the argument error);
- ``AuxCaptureError`` cases of the aux-stream pass: a marker with no AttnRes op, a
  duplicate capture id, ids that contradict their consumer (layer, output aggregation,
  ``num_blocks``, out of range), two consumers, a boundary tap on a non-final stage;
- stream selection: unknown streams from the argument, the environment, backend options
  and drafter configs, and malformed drafter config files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError
from torch._subclasses.fake_tensor import FakeTensorMode

from kimi_passes import AuxCaptureError, AuxStreamPass, aux_tap, make_kimi_backend
from kimi_passes.config.checkpoint import CheckpointError
from kimi_passes.graphs.k3 import K3Config, K3Model
from kimi_passes.ops import AttnResArgumentError

OPS = torch.ops.kimi
T, H, NB = 3, 8, 2

# What is refused, and how, is decided before lowering: compiles use Inductor's
# fallback_by_default (ATen calls, no C++ kernel built), as the goldens do.
pytestmark = pytest.mark.usefixtures("aten_fallback")
F32, BF16 = torch.float32, torch.bfloat16


@dataclass
class Case:
    name: str
    fn: Callable[[Any], Any]  # takes a Ctx
    exc: type[BaseException]
    match: str
    #: for wrapped errors (BackendCompilerFailed): the type of ``inner_exception``
    inner: type[BaseException] | None = None
    marks: tuple = field(default_factory=tuple)


@dataclass
class Ctx:
    monkeypatch: pytest.MonkeyPatch
    tmp_path: Any


# --------------------------------------------------------------------------- op arguments


def op_args(**over):
    """Valid ``kimi::attn_res`` arguments (T=3, H=8, NB=2) with ``over`` replacing some."""
    args = {
        "prefix": torch.randn(T, H),
        "delta": torch.randn(T, H),
        "blocks": torch.randn(T, NB, H),
        "norm_weight": torch.ones(H),
        "qk_weight": torch.randn(H),
        "output_norm_weight": torch.ones(H),
        "num_blocks": 1,
        "block_write_idx": 0,
        "eps": 1e-6,
        "output_norm_eps": 1e-6,
    }
    for k, v in over.items():
        args[k] = v() if callable(v) else v
    return args


MIX_KEYS = ("prefix", "blocks", "norm_weight", "qk_weight", "num_blocks", "eps")


def call_op(op_name: str, over: dict, fake: bool):
    def run():
        a = op_args(**over)
        if op_name == "attn_res_mix":
            return OPS.attn_res_mix(*(a[k] for k in MIX_KEYS))
        if op_name.startswith("attn_res_quant"):  # the mixture's checks come first
            return getattr(OPS, op_name)(*a.values(), torch.float8_e4m3fn)
        return getattr(OPS, op_name)(*a.values())

    if fake:
        with FakeTensorMode():
            return run()
    return run()


def _t(*shape, dtype=F32, device="cpu"):
    return lambda: torch.randn(*shape, dtype=dtype, device=device)


# (rule name, overrides, message regex, applies to attn_res_mix)
RULES = [
    # ranks
    ("prefix rank", {"prefix": _t(T, 1, H)}, r"prefix must be 2-D \[T, H\], got shape "
     r"\(3, 1, 8\) \(3-D\)", True),
    ("delta rank", {"delta": _t(T * H)}, r"delta must be 2-D \[T, H\], got shape \(24,\)",
     False),
    ("blocks rank", {"blocks": _t(T, H)}, r"blocks must be 3-D \[T, NB, H\], got shape "
     r"\(3, 8\) \(2-D\)", True),
    ("norm_weight rank", {"norm_weight": _t(1, H)}, r"norm_weight must be 1-D \[H\]", True),
    # K3's checkpoint stores the projection as [1, H]: passing it unflattened is refused.
    ("qk_weight rank", {"qk_weight": _t(1, H)}, r"qk_weight must be 1-D \[H\], got shape "
     r"\(1, 8\)", True),
    ("output_norm_weight rank", {"output_norm_weight": _t(H, 1)},
     r"output_norm_weight must be 1-D \[H\]", False),
    # dtypes
    ("unsupported dtype float64",
     {k: _t(*s, dtype=torch.float64) for k, s in
      (("prefix", (T, H)), ("delta", (T, H)), ("blocks", (T, NB, H)),
       ("norm_weight", (H,)), ("qk_weight", (H,)), ("output_norm_weight", (H,)))},
     r"prefix dtype torch.float64 is not supported; use one of \['torch.float32', "
     r"'torch.bfloat16', 'torch.float16'\]", True),
    ("unsupported dtype int32", {"prefix": lambda: torch.ones(T, H, dtype=torch.int32)},
     r"prefix dtype torch.int32 is not supported", True),
    *[(f"{name} dtype mismatch", {name: _t(*shape, dtype=BF16)},
       rf"{name} dtype torch.bfloat16 differs from prefix dtype torch.float32", name != "delta"
       and name != "output_norm_weight")
      for name, shape in (("delta", (T, H)), ("blocks", (T, NB, H)), ("norm_weight", (H,)),
                          ("qk_weight", (H,)), ("output_norm_weight", (H,)))],
    # devices (meta: the one other device every machine has)
    *[(f"{name} device mismatch", {name: _t(*shape, device="meta")},
       rf"{name} is on meta but prefix is on cpu; move every tensor to one device",
       name not in ("delta", "output_norm_weight"))
      for name, shape in (("delta", (T, H)), ("blocks", (T, NB, H)), ("norm_weight", (H,)),
                          ("qk_weight", (H,)), ("output_norm_weight", (H,)))],
    ("prefix device mismatch", {"prefix": _t(T, H, device="meta")},
     r"(delta|blocks) is on cpu but prefix is on meta", True),
    # hidden size, for each tensor
    *[(f"{name} H mismatch", {name: _t(*shape)},
       rf"hidden size mismatch: {name} has H=9 \(shape {re.escape(str(shape))}\) but prefix "
       r"has H=8", name not in ("delta", "output_norm_weight"))
      for name, shape in (("delta", (T, 9)), ("blocks", (T, NB, 9)), ("norm_weight", (9,)),
                          ("qk_weight", (9,)), ("output_norm_weight", (9,)))],
    ("prefix H mismatch", {"prefix": _t(T, 9)},
     r"hidden size mismatch: (delta|blocks) has H=8 .* but prefix has H=9", True),
    # token count
    ("delta T mismatch", {"delta": _t(T + 1, H)},
     r"token count mismatch: delta has T=4 \(shape \(4, 8\)\) but prefix has T=3", False),
    ("blocks T mismatch", {"blocks": _t(T + 1, NB, H)},
     r"token count mismatch: blocks has T=4 \(shape \(4, 2, 8\)\) but prefix has T=3", True),
    # index ranges, both sides
    ("num_blocks below 0", {"num_blocks": -1},
     r"num_blocks=-1 is outside \[0, 2\] \(blocks has NB=2 slots\)", True),
    ("num_blocks above NB", {"num_blocks": NB + 1}, r"num_blocks=3 is outside \[0, 2\]", True),
    ("block_write_idx below -1", {"block_write_idx": -2},
     r"block_write_idx=-2 is outside \[-1, 2\) \(blocks has NB=2 slots; -1 means no write\)",
     False),
    ("block_write_idx at NB", {"block_write_idx": NB}, r"block_write_idx=2 is outside \[-1, 2\)",
     False),
    # epsilons
    ("negative eps", {"eps": -1e-6}, r"eps=-1e-06 must be a non-negative float", True),
    ("nan eps", {"eps": float("nan")}, r"eps=nan must be a non-negative float", True),
    ("negative output_norm_eps", {"output_norm_eps": -1.0},
     r"output_norm_eps=-1.0 must be a non-negative float", False),
]


def op_cases() -> list[Case]:
    cases = []
    for rule, over, regex, on_mix in RULES:
        for op_name in ("attn_res", "attn_res_capture", "attn_res_quant",
                        "attn_res_quant_capture") + (("attn_res_mix",) if on_mix else ()):
            for fake in (False, True):
                mode = "fake" if fake else "eager"
                cases.append(Case(
                    f"{op_name}: {rule} ({mode})",
                    lambda ctx, o=op_name, v=over, f=fake: call_op(o, v, f),
                    AttnResArgumentError, rf"^kimi attn_res: {regex}"))
    return cases


def _tap_bad_id(capture_id, fake=False):
    def run(ctx):
        if fake:
            with FakeTensorMode():
                return OPS.aux_tap(torch.randn(T, H), capture_id)
        return aux_tap(torch.randn(T, H), capture_id)

    return run


def _compiled_bad_num_blocks(ctx):
    blocks, w = torch.randn(T, NB, H), torch.ones(H)

    def f(prefix):
        return OPS.attn_res(prefix, None, blocks, w, w, None, NB + 1, -1, 1e-6, 1e-6)

    return compile_(f)(torch.randn(T, H))


TAP_CASES = [
    Case("aux_tap: negative capture id", _tap_bad_id(-1), AttnResArgumentError,
         r"kimi aux_tap: capture_id must be a non-negative int .* got -1"),
    Case("aux_tap: bool capture id", _tap_bad_id(True), AttnResArgumentError,
         r"capture_id must be a non-negative int .* got True"),
    Case("aux_tap: float capture id", _tap_bad_id(2.0), AttnResArgumentError,
         r"capture_id must be a non-negative int .* got 2.0"),
    Case("aux_tap: negative capture id (fake)", _tap_bad_id(-3, fake=True), AttnResArgumentError,
         r"capture_id must be a non-negative int .* got -3"),
    Case("aux_tap: 0-D tensor", lambda ctx: aux_tap(torch.tensor(1.0), 0), AttnResArgumentError,
         r"kimi aux_tap: x must be a hidden-state tensor \[\.\.\., H\], got a 0-D tensor"),
    # Inside torch.compile the fake kernel refuses; Dynamo reports it as TorchRuntimeError
    # quoting the argument error (no __cause__), at compile time, not when serving.
    Case("torch.compile: attn_res num_blocks out of range", _compiled_bad_num_blocks,
         TorchRuntimeError,
         r"(?s)got AttnResArgumentError\('kimi attn_res: num_blocks=3 is outside \[0, 2\]"),
    Case("torch.compile: aux_tap negative capture id",
         lambda ctx: compile_(lambda x: aux_tap(x, -1) * 2)(torch.randn(T, H)),
         TorchRuntimeError, r"(?s)got AttnResArgumentError\('kimi aux_tap: capture_id must be"),
]


# --------------------------------------------------------------------------- models


def compile_(fn, backend=None, **kw):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend or make_kimi_backend(), fullgraph=True,
                         dynamic=False, **kw)


def k3(num_layers=2, block_size=1, taps=(1,)):
    return K3Config(num_layers=num_layers, hidden_size=16, attn_res_block_size=block_size,
                    num_heads=2, intermediate_size=32, vocab_size=64, aux_layer_ids=taps)


class RemappedTaps(K3Model):
    """The reference K3 with some taps given another capture id (a mis-wired model)."""

    def __init__(self, cfg, start=0, end=None, remap=None):
        super().__init__(cfg, start, end)
        self.remap = dict(remap or {})

    def _tap(self, k, *rest):
        return super()._tap(self.remap.get(k, k), *rest)


def stage_inputs(model: K3Model, tokens: int = 5):
    if model.is_first:
        return (torch.arange(tokens) % model.config.vocab_size,)
    H = model.config.hidden_size
    return torch.randn(tokens, H), torch.randn(tokens, model.bank_slots, H)


def run_k3(make_model, **backend_kw):
    """Compile ``make_model()`` with ``make_kimi_backend(**backend_kw)`` (built when run)."""

    def run(ctx):
        model = make_model()
        with torch.no_grad():
            return compile_(model, make_kimi_backend(**backend_kw))(*stage_inputs(model))

    return run


class _Mixer(nn.Module):
    def __init__(self, nb: int, write: int):
        super().__init__()
        g = torch.Generator().manual_seed(nb * 10 + write)
        self.norm = nn.Parameter(torch.ones(16), requires_grad=False)
        self.proj = nn.Parameter(torch.randn(16, generator=g) / 4, requires_grad=False)
        self.onorm = nn.Parameter(torch.ones(16), requires_grad=False)
        self.nb, self.write = nb, write

    def forward(self, prefix, delta, bank):
        return OPS.attn_res(prefix, delta, bank, self.norm, self.proj, self.onorm, self.nb,
                            self.write, 1e-6, 1e-6)


class BadNumBlocks(nn.Module):
    """Layers 2 and 3 of an S=2 model; layer 3 mixes num_blocks=1 where cdiv(3, 2) = 2."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"2": _Mixer(1, 1), "3": _Mixer(1, -1)})

    def forward(self, prefix, pending, bank):
        h = self.layers["2"](prefix, pending, bank)  # writes block 1 = layer 2 // S
        tap = aux_tap(prefix + h, 3)
        out = self.layers["3"](prefix, h, bank)
        return out, tap


def _bad_num_blocks(ctx):
    with torch.no_grad():
        args = (torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 2, 16))
        return compile_(BadNumBlocks())(*args)


def _two_consumers(ctx):
    bank, w, q = torch.randn(4, 2, 16), torch.ones(16), torch.randn(16)

    def f(x):
        tap = aux_tap(x, 0)
        a = OPS.attn_res_mix(x, bank, w, q, 1, 1e-6)
        b = OPS.attn_res_mix(x, bank, w, q, 2, 1e-6)
        return tap, a, b

    return compile_(f)(torch.randn(4, 16))


def _marker_only(**backend_kw):
    def run(ctx):
        backend = make_kimi_backend(**backend_kw)
        return compile_(lambda x: aux_tap(x, 0) * 2, backend)(torch.randn(4, 16))

    return run


BOUNDARY = r"capture id 1 has no consumer in this graph \(pipeline non-final stage owning " \
    r"layers \[0, 1\)\): the layer that reads it lives on the next pipeline stage.*Remedy"
NO_ATTN_RES = r"capture id 0: the aux tap marker has no AttnRes op to mix with in this graph"


def _draft_file(content: str | None, name="config.json"):
    """A drafter config path under tmp_path holding ``content`` (None: no file)."""

    def path(ctx):
        p = ctx.tmp_path / "drafter" / name
        p.parent.mkdir(exist_ok=True)
        if content is not None:
            p.write_text(content)
        return p

    return path


def _backend_with_draft(content, name="config.json", **kw):
    return lambda ctx: make_kimi_backend(draft_config=_draft_file(content, name)(ctx), **kw)


def _with_env(value, then):
    def run(ctx):
        ctx.monkeypatch.setenv("KIMI_PASSES_AUX_STREAM", value)
        return then(ctx)

    return run


def _compile_by_name(options=None):
    def run(ctx):
        torch._dynamo.reset()
        f = torch.compile(lambda x: x * 2, backend="kimi", options=options, fullgraph=True)
        return f(torch.randn(4, 16))

    return run


def _boundary_with_draft_file(ctx):
    path = _draft_file(json.dumps({"aux_hidden_stream": "attn_res"}))(ctx)
    return run_k3(lambda: K3Model(k3(), 0, 1), draft_config=path)(ctx)


STREAM = r"kimi_passes: unknown aux stream {} from {}; use one of \['attn_res', 'prefix'\]"

PASS_CASES = [
    Case("marker without AttnRes ops", _marker_only(), AuxCaptureError, NO_ATTN_RES),
    Case("marker without AttnRes ops, drafter asks attn_res",
         _marker_only(draft_config={"aux_hidden_stream": "attn_res"}),
         AuxCaptureError, NO_ATTN_RES),
    Case("duplicate capture id", run_k3(lambda: RemappedTaps(k3(4, 2, (0, 2)), remap={2: 0})),
         AuxCaptureError,
         r"capture id 0 is claimed by two aux taps \(\w+ and \w+\) in the pipeline final "
         r"stage owning layers \[0, 4\); each capture id must be tapped once"),
    Case("duplicate capture id, prefix stream",
         run_k3(lambda: RemappedTaps(k3(4, 2, (0, 2)), remap={2: 0}), aux_stream="prefix"),
         AuxCaptureError, r"capture id 0 is claimed by two aux taps"),
    Case("capture id wrong for its layer",
         run_k3(lambda: RemappedTaps(k3(4, 2, (2,)), remap={2: 3})), AuxCaptureError,
         r"capture id 3 contradicts its consumer: the tapped value is read by layer 2's "
         r"pre-attention mixing .* not layer 3.*use capture id 2"),
    Case("capture id out of range", run_k3(lambda: RemappedTaps(k3(4, 2, (1,)), remap={1: 99})),
         AuxCaptureError, r"capture id 99 contradicts its consumer: .* read by layer 1's"),
    Case("capture id wrong for the output aggregation",
         run_k3(lambda: RemappedTaps(k3(4, 2, (4,)), remap={4: 3})), AuxCaptureError,
         r"capture id 3 contradicts its consumer: the tapped value is read by the output "
         r"aggregation of the pipeline final stage owning layers \[0, 4\), which is capture "
         r"id 4"),
    Case("capture id contradicts the consumer's num_blocks", _bad_num_blocks, AuxCaptureError,
         r"capture id 3 contradicts its consumer layer 3 kimi::attn_res\(num_blocks=1, "
         r"block_write_idx=-1\) .* block size 2, .* cdiv\(3, 2\) = 2 completed blocks, but the "
         r"consumer mixes num_blocks=1"),
    Case("tapped value with two consumers", _two_consumers, AuxCaptureError,
         r"capture id 0: the tapped value is mixed by 2 AttnRes calls"),
    Case("boundary tap on a non-final stage", run_k3(lambda: K3Model(k3(), 0, 1)), AuxCaptureError,
         BOUNDARY),
    Case("boundary tap, 3 stages, middle stage",
         run_k3(lambda: K3Model(k3(6, 2, (0, 4, 6)), 2, 4)), AuxCaptureError,
         r"capture id 4 has no consumer in this graph \(pipeline non-final stage owning "
         r"layers \[2, 4\)\)"),
    Case("boundary tap, drafter config dict asks attn_res",
         run_k3(lambda: K3Model(k3(), 0, 1), draft_config={"aux_hidden_stream": "attn_res"}),
         AuxCaptureError, BOUNDARY),
    Case("boundary tap, drafter config file asks attn_res", _boundary_with_draft_file,
         AuxCaptureError, BOUNDARY),
    Case("boundary tap, explicit attn_res over a prefix drafter",
         run_k3(lambda: K3Model(k3(), 0, 1), aux_stream="attn_res",
                draft_config={"aux_hidden_stream": "prefix"}),
         AuxCaptureError, BOUNDARY),
    # With the FX graph cache off (force_disable_caches, as graph-inspecting tests use),
    # Inductor's cache-bypass path wraps every exception in InductorError; KimiBackend
    # hands AuxCaptureError on unwrapped, so `except AuxCaptureError` works either way.
    Case("boundary tap, FX graph cache disabled",
         run_k3(lambda: K3Model(k3(), 0, 1), force_disable_caches=True),
         AuxCaptureError, BOUNDARY),
    Case("boundary tap, FX graph cache off (fx_graph_cache=False)",
         run_k3(lambda: K3Model(k3(), 0, 1), fx_graph_cache=False),
         AuxCaptureError, BOUNDARY),
]

STREAM_CASES = [
    Case("unknown stream argument", lambda ctx: make_kimi_backend(aux_stream="bogus"),
         ValueError, STREAM.format("'bogus'", "the aux_stream argument")),
    Case("unknown stream in the environment",
         _with_env("bogus", lambda ctx: make_kimi_backend()), ValueError,
         STREAM.format("'bogus'", r"\$KIMI_PASSES_AUX_STREAM")),
    Case("unknown stream in the environment over a valid drafter",
         _with_env("bogus", lambda ctx: make_kimi_backend(
             draft_config={"aux_hidden_stream": "attn_res"})), ValueError,
         STREAM.format("'bogus'", r"\$KIMI_PASSES_AUX_STREAM")),
    Case("unknown stream to AuxStreamPass", lambda ctx: AuxStreamPass("bogus"), ValueError,
         r"AuxStreamPass: unknown stream 'bogus'; use one of \['attn_res', 'prefix'\]"),
    # backend="kimi": the options reach the backend inside torch.compile, so Dynamo wraps
    # the ValueError; the message keeps it: "backend='kimi' raised:\nValueError: ...".
    Case("unknown stream in torch.compile options",
         _compile_by_name({"aux_stream": "bogus"}), BackendCompilerFailed,
         r"backend='kimi' raised:\nValueError: " + STREAM.format("'bogus'",
                                                                 "the aux_stream argument"),
         inner=ValueError),
    Case("unknown stream in the environment, backend by name",
         _with_env("bogus", _compile_by_name()), BackendCompilerFailed,
         r"backend='kimi' raised:\nValueError: "
         + STREAM.format("'bogus'", r"\$KIMI_PASSES_AUX_STREAM"), inner=ValueError),
    Case("drafter asks an unknown stream",
         lambda ctx: make_kimi_backend(draft_config={"aux_hidden_stream": "post_norm"}),
         ValueError,
         STREAM.format("'post_norm'", r"the drafter config \(a dict\): aux_hidden_stream")),
    Case("drafter stream is null",
         lambda ctx: make_kimi_backend(draft_config={"aux_hidden_stream": None}),
         ValueError, STREAM.format("None", r"the drafter config \(a dict\): aux_hidden_stream")),
    Case("drafter file asks an unknown stream",
         _backend_with_draft(json.dumps({"aux_hidden_stream": "post_norm"})), ValueError,
         STREAM.format("'post_norm'", r"the drafter config .*config\.json: aux_hidden_stream")),
    Case("drafter config: invalid JSON", _backend_with_draft('{"aux_hidden_stream": '),
         CheckpointError, r"drafter config .*config\.json is not valid JSON \(Expecting value at "
         r"line 1\); fix the file or pass aux_stream explicitly"),
    Case("drafter config: a JSON list", _backend_with_draft('["attn_res"]'), CheckpointError,
         r"drafter config .*config\.json must hold a JSON object, got list"),
    Case("drafter config: a JSON string", _backend_with_draft('"attn_res"'), CheckpointError,
         r"must hold a JSON object, got str"),
    Case("drafter config: missing file", _backend_with_draft(None), CheckpointError,
         r"kimi_passes: drafter config .*drafter/config\.json does not exist"),
    Case("drafter config: folder without config.json",
         lambda ctx: make_kimi_backend(draft_config=_draft_file(None)(ctx).parent),
         CheckpointError, r"drafter config .*drafter/config\.json does not exist"),
    Case("drafter config: malformed even when aux_stream overrides it",
         _backend_with_draft("not json", aux_stream="prefix"), CheckpointError,
         r"is not valid JSON"),
    Case("drafter config: missing file in torch.compile options",
         _compile_by_name({"draft_config": "/nonexistent/drafter/config.json"}),
         BackendCompilerFailed,
         r"backend='kimi' raised:\nCheckpointError: kimi_passes: drafter config "
         r"/nonexistent/drafter/config\.json does not exist", inner=CheckpointError),
    # The reference model refuses capture ids outside [0, L] and duplicates up front.
    Case("K3Config: capture id above L", lambda ctx: k3(4, 2, (0, 5)), ValueError,
         r"aux_layer_ids \(0, 5\) must be distinct capture ids in \[0, 4\]"),
    Case("K3Config: duplicate capture id", lambda ctx: k3(4, 2, (2, 2)), ValueError,
         r"aux_layer_ids \(2, 2\) must be distinct capture ids"),
]

CASES = op_cases() + TAP_CASES + PASS_CASES + STREAM_CASES


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=c.marks) for c in CASES])
def test_refused_loudly(case: Case, monkeypatch, tmp_path):
    monkeypatch.delenv("KIMI_PASSES_AUX_STREAM", raising=False)
    with pytest.raises(BaseException) as info:
        case.fn(Ctx(monkeypatch, tmp_path))
    err = info.value
    assert type(err) is case.exc, (
        f"{case.name}: expected {case.exc.__name__}, got {type(err).__module__}."
        f"{type(err).__qualname__}: {err}")
    assert re.search(case.match, str(err)), f"{case.name}: message does not match:\n{err}"
    if case.inner is not None:
        assert type(err.inner_exception) is case.inner, err.inner_exception


def test_every_validation_rule_has_a_row(monkeypatch, tmp_path):
    """Each message template of the ops' checks (ops/attn_res_ops.py, ops/aux_tap.py) is
    produced by some row above."""
    import inspect

    from kimi_passes.ops import attn_res_ops, aux_tap

    source = inspect.getsource(attn_res_ops) + inspect.getsource(aux_tap)
    templates = re.findall(r'f?"(kimi (?:attn_res|aux_tap): [^"]*)"', source)
    assert len(templates) >= 11, templates
    messages = []
    for case in op_cases() + TAP_CASES[:5]:
        try:
            case.fn(Ctx(monkeypatch, tmp_path))
        except AttnResArgumentError as e:
            messages.append(str(e))
    for t in templates:
        pattern = ".*?".join(re.escape(part) for part in re.split(r"\{[^}]*\}", t))
        assert any(re.search(pattern, m) for m in messages), f"no row raises {t!r}"


# ------------------------------------------------------- the remedies the messages name


@torch.no_grad()
def test_prefix_stream_remedy_compiles_a_boundary_tap():
    """The boundary refusal names aux_stream='prefix' as a remedy: it must compile."""
    stage = K3Model(k3(), 0, 1)
    (hidden, _), taps = compile_(stage, make_kimi_backend(aux_stream="prefix"))(
        *stage_inputs(stage))
    torch.testing.assert_close(taps[0], hidden, atol=0, rtol=0)


def test_prefix_stream_remedy_compiles_a_marker_without_attn_res():
    """The no-AttnRes refusal names aux_stream='prefix' as a remedy: it must compile."""
    x = torch.randn(4, 16)
    out = compile_(lambda x: aux_tap(x, 0) * 2, make_kimi_backend(aux_stream="prefix"))(x)
    torch.testing.assert_close(out, 2 * x)
