"""Golden post-pass graphs: what the passes leave, in graph_text's ``"kimi"`` view.

Each scenario compiles a small static-shape K3 (or one stage of it) through
``GraphRecorder`` (kimi_backend's passes, recording the post-grad graph after
them), compares ``graph_text(graph, view="kimi")`` with ``graphs/golden/<name>.txt``,
and also checks the kimi op counts and the taps against ``ground_truth``. The view
holds every kimi call, each argument named by what produces it, and what the graph
returns, and none of the unrelated ops torch releases order and decompose differently:
the same files hold on every supported torch (docs/testing.md).

Update the goldens after an intended change with::

    EXPECTTEST_ACCEPT=1 python -m pytest tests/test_goldens.py

The compiles use Inductor's ``fallback_by_default`` (every op an ATen call): the
post-grad graph and the passes are the same (fallbacks are chosen when lowering,
after the passes), but no C++ kernel is built, which keeps these tests fast.
"""

from __future__ import annotations

import difflib
import operator
import os
import re
from pathlib import Path
from unittest import mock

import expecttest
import pytest
import torch
from helpers.k3 import ids
from helpers.op import OP_TOL
from torch._dynamo.exc import BackendCompilerFailed

import kimi_passes.graphs
from kimi_passes import AuxCaptureError, AuxStreamPass, graph_text
from kimi_passes.debug.graph_text import KIMI_OPS, MIXTURE_OPS, kimi_op_counts
from kimi_passes.debug.recording import GraphRecorder
from kimi_passes.graphs import K3Config, K3Model
from kimi_passes.quant import FuseQuantPass

GOLDEN_DIR = Path(kimi_passes.graphs.__file__).resolve().parent / "golden"
FAST = {"fallback_by_default": True}

pytestmark = pytest.mark.usefixtures("caches_off")


def accepting() -> bool:
    """expecttest's switch: EXPECTTEST_ACCEPT=1 rewrites goldens instead of comparing."""
    return bool(os.environ.get("EXPECTTEST_ACCEPT") or getattr(expecttest, "ACCEPT", None))


def golden_diff(name: str, expected: str, actual: str) -> str:
    """A unified diff; first with node numbers blanked when that changes fewer lines.

    One node more or less renumbers every later ``v<i>``; the blanked diff shows only
    the lines that really changed.
    """
    def diff(a: str, b: str) -> str:
        return "".join(difflib.unified_diff(
            a.splitlines(keepends=True), b.splitlines(keepends=True),
            fromfile=f"golden/{name}.txt", tofile="actual"))

    def changed(d: str) -> int:
        return sum(1 for x in d.splitlines() if x[:1] in ("+", "-") and x[:3] not in ("+++", "---"))

    full = diff(expected, actual)
    blank = lambda t: re.sub(r"\b([vk])\d+\b", r"\1#", t)
    short = diff(blank(expected), blank(actual))
    text = f"graph differs from golden {name}.txt"
    if short and changed(short) < changed(full):
        text += f"\n\nchanged lines, node numbers blanked (v#):\n{short}"
    return text + f"\n\nfull diff:\n{full}"


class GoldenTestCase(expecttest.TestCase):
    """``assertGolden(name, text)``: compare with ``graphs/golden/<name>.txt`` (or rewrite it)."""

    golden_dir = GOLDEN_DIR

    def assertGolden(self, name: str, actual: str) -> None:
        path = self.golden_dir / f"{name}.txt"
        if accepting():
            if not path.exists() or path.read_text() != actual:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(actual)
            return
        if not path.exists():
            self.fail(f"golden {path} does not exist; create it with EXPECTTEST_ACCEPT=1")
        expected = path.read_text()
        if expected != actual:
            self.fail(golden_diff(name, expected, actual)
                      + "\nIf the change is intended, rerun with EXPECTTEST_ACCEPT=1.")


def compile_stage(model, *inputs, dynamic: bool = False, **options):
    """Compile ``model`` through a GraphRecorder, run it; (recorder, out, taps).

    The pass's AuxCaptureError comes out unwrapped (Dynamo wraps backend errors).
    """
    recorder = GraphRecorder(**FAST, **options)
    torch._dynamo.reset()
    if dynamic:
        torch._dynamo.mark_dynamic(inputs[0], 0)
    with torch.no_grad():
        try:
            out, taps = torch.compile(model, backend=recorder, fullgraph=True)(*inputs)
        except BackendCompilerFailed as e:
            if isinstance(e.inner_exception, AuxCaptureError):
                raise e.inner_exception from None
            raise
    return recorder, out, taps


def small(num_layers=3, block_size=2, taps=(0, 2, 3), dtype=torch.float32,
          fp8_inputs=None) -> K3Config:
    return K3Config(num_layers=num_layers, hidden_size=16, attn_res_block_size=block_size,
                    num_heads=2, intermediate_size=32, vocab_size=64,
                    aux_layer_ids=taps, dtype=dtype, fp8_inputs=fp8_inputs)


def counts(attn_res=0, capture=0, mix=0, tap=0, quant=0, quant_capture=0) -> dict[str, int]:
    """kimi_op_counts of a golden graph: these ops as given, every other kimi op 0."""
    return {**dict.fromkeys(KIMI_OPS, 0), "attn_res": attn_res, "attn_res_capture": capture,
            "attn_res_mix": mix, "aux_tap": tap, "attn_res_quant": quant,
            "attn_res_quant_capture": quant_capture}


class TestGoldens(GoldenTestCase):
    def check(self, name, model, inputs, *, op_counts, stream="attn_res", dynamic=False,
              **options):
        """Compile, compare the golden, the op counts and the taps; returns the recorder."""
        rec, self.out, taps = compile_stage(model, *inputs, dynamic=dynamic,
                                            aux_stream=stream, **options)
        self.assertEqual(len(rec.graphs), 1)
        self.assertGolden(name, rec.last.text("kimi"))
        self.assertEqual(kimi_op_counts(rec.last.after), op_counts)
        self.assertEqual(rec.last.counts("before")["aux_tap"], len(model.capture_ids))
        with torch.no_grad():
            ref = (model.ground_truth if stream == "attn_res" else model)(*inputs)[1]
        tol = OP_TOL[model.config.dtype]
        self.assertEqual(len(taps), len(ref))
        for k, got, want in zip(model.capture_ids, taps, ref, strict=True):
            err = (got.float() - want.float()).abs().max().item()
            self.assertLessEqual(err, tol, f"capture id {k}: max abs err {err:.3g} > {tol}")
        self.assertEqual([r.capture_id for r in rec.last.rewrites], list(model.capture_ids))
        self.assertTrue(all(r.stream == stream for r in rec.last.rewrites))
        return rec

    # -- attn_res vs prefix stream, full view of a one-layer model --------------------------
    def test_minimal_attn_res(self):
        model = K3Model(small(num_layers=1, block_size=1, taps=(0, 1)))
        rec = self.check("minimal_attn_res", model, (ids(),),
                         op_counts=counts(attn_res=2, capture=1))
        self.assertEqual([r.fused for r in rec.last.rewrites], [True, True])

    def test_minimal_prefix(self):
        model = K3Model(small(num_layers=1, block_size=1, taps=(0, 1)))
        rec = self.check("minimal_prefix", model, (ids(),), stream="prefix",
                         op_counts=counts(attn_res=3))
        self.assertEqual([r.fused for r in rec.last.rewrites], [None, None])

    # -- taps at 0, at a block-write layer and at L; fused and not ----------------------------
    def test_taps_0_write_L_fused(self):
        model = K3Model(small())
        rec = self.check("taps_0_write_L_fused", model, (ids(),),
                         fuse_capture=True, op_counts=counts(attn_res=5, capture=2))
        self.assertEqual([r.fused for r in rec.last.rewrites], [True, True, True])
        self.assertIn("block_write_idx=1", rec.last.rewrites[1].consumer)

    def test_taps_0_write_L_fused_v1(self):
        """vLLM's default, auto_functionalized (v1): the consumers' kernels emit the mixture,
        and the graph prints as the v2 golden (taps_0_write_L_fused), byte for byte; that the
        graph really is v1 is checked on the nodes."""
        model = K3Model(small())
        with torch._inductor.config.patch(enable_auto_functionalized_v2=False):
            rec = self.check("taps_0_write_L_fused", model, (ids(),),
                             fuse_capture=True, op_counts=counts(attn_res=5, capture=2))
        af = [n for n in rec.last.after.nodes if "auto_functionalized" in str(n.target)]
        self.assertEqual(len(af), 7)
        self.assertTrue(all(str(n.target) == "auto_functionalized" for n in af))
        self.assertEqual([r.fused for r in rec.last.rewrites], [True, True, True])

    def test_a_changed_rewrite_fails_its_golden(self):
        """The goldens guard the rewrite: a pass that hands the tap the consumer's running
        prefix (the silent failure this project exists for) no longer matches."""
        def prefix_instead(self, graph, call):
            return call.getitem(call.output_index("prefix")), True

        model = K3Model(small())
        with mock.patch.object(AuxStreamPass, "_mixture", prefix_instead):
            rec, _, _ = compile_stage(model, ids(), fuse_capture=True)
        with mock.patch.dict(os.environ, {"EXPECTTEST_ACCEPT": ""}), \
                mock.patch.object(expecttest, "ACCEPT", None, create=True), \
                self.assertRaisesRegex(AssertionError, "differs from golden"):
            self.assertGolden("taps_0_write_L_fused", rec.last.text("kimi"))

    def test_taps_0_write_L_unfused(self):
        model = K3Model(small())
        rec = self.check("taps_0_write_L_unfused", model, (ids(),),
                         fuse_capture=False, op_counts=counts(attn_res=7, mix=3))
        self.assertEqual([r.fused for r in rec.last.rewrites], [False, False, False])

    def test_auto_functionalized_v1_prints_like_v2(self):
        """auto_functionalized (v1) and _v2 print the kimi calls and their outputs alike.

        (Other nodes may come in another order, so only the kimi lines are compared, with
        node names blanked.)
        """
        model = K3Model(small(num_layers=1, block_size=1, taps=(0, 1)))

        def kimi_lines(v2: bool) -> list[str]:
            with torch._inductor.config.patch(enable_auto_functionalized_v2=v2):
                rec, _, taps = compile_stage(model, ids(), fuse_capture=False)
            with torch.no_grad():
                for got, want in zip(taps, model.ground_truth(ids())[1], strict=True):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            wrapper = "auto_functionalized_v2" if v2 else "auto_functionalized"
            af = [n for n in rec.last.after.nodes if "auto_functionalized" in str(n.target)]
            self.assertTrue(af and all(str(n.target) == wrapper for n in af))
            text = re.sub(r"\bv\d+\b", "v#", rec.last.text("skeleton"))
            kimi = re.compile(r"kimi\.|\.ret\[|\.updated\.")
            return sorted(x for x in text.splitlines() if kimi.search(x))

        v1, v2 = kimi_lines(False), kimi_lines(True)
        self.assertEqual(len(v2), 14)  # 3 calls, 3 getitems each, 2 attn_res_mix (taps 0, 1)
        self.assertEqual(v1, v2)

    # -- pipeline: the final stage, fed the first stage's bundle --------------------------------
    def test_pipeline_final_stage(self):
        cfg = small()
        with torch.no_grad():
            (hidden, bank), _ = K3Model(cfg, 0, 2)(ids())
        final = K3Model(cfg, start_layer=2)
        self.assertEqual(final.capture_ids, (2, 3))
        self.check("pipeline_final_stage", final, (hidden, bank),
                   op_counts=counts(attn_res=2, capture=1))

    # -- dtype and dynamic tokens ------------------------------------------------------------------
    def test_bf16(self):
        model = K3Model(small(dtype=torch.bfloat16))
        self.check("bf16", model, (ids(),),
                   op_counts=counts(attn_res=5, capture=2))

    def test_dynamic_tokens(self):
        model = K3Model(small(num_layers=2, block_size=1, taps=(0, 1, 2)))
        rec = self.check("dynamic_tokens", model, (ids(6),), dynamic=True,
                         op_counts=counts(attn_res=3, capture=2))
        text = rec.last.text("skeleton")
        self.assertIn("input s0: Sym(s0)", text)
        self.assertIn("f32[s0, 16]", text)

    # -- FP8 projections: each layer's AttnRes outputs quantized per token -------------------
    def test_fp8_inputs(self):
        """A bf16 K3 whose attention and MLP read their input quantized per token (the AMD
        kernel's formula): FuseQuantPass makes each of the 6 layer sites one quantizing
        call, the 2 tapped ones capture variants; the output aggregation (read by the
        final norm and tap 3) stays attn_res. The fused model's output equals the unfused
        one's bit for bit."""
        model = K3Model(small(dtype=torch.bfloat16, fp8_inputs=torch.float8_e4m3fn))
        rec = self.check("fp8_inputs", model, (ids(),),
                         op_counts=counts(attn_res=1, quant=4, quant_capture=2))
        self.assertEqual(rec.last.counts("before")["attn_res_quant"], 0)
        self.assertEqual([f.skipped for f in rec.backend.passes.get(FuseQuantPass).last_fusions],
                         [None] * 6)
        unfused = compile_stage(model, ids(), fuse_quant=False)[1]
        self.assertTrue(torch.equal(self.out, unfused))

    # -- the boundary refusal -------------------------------------------------------------
    def test_boundary_refusal(self):
        stage = K3Model(small(), 0, 2)
        self.assertEqual(stage.capture_ids, (0, 2))
        self.assertExpectedRaisesInline(
            AuxCaptureError, lambda: compile_stage(stage, ids()),
            """capture id 2 has no consumer in this graph (pipeline non-final stage owning layers [0, 2)): the layer that reads it lives on the next pipeline stage (the tap at layer 2). Its mixture cannot be computed here and falling back to the running prefix would silently feed the drafter a different value. Remedy: drop capture id 2 on this stage and tap it on the stage that owns layer 2 (as its first layer's capture id), or compile with aux_stream='prefix' if the drafter was trained on the prefix stream""",  # noqa: E501
        )


class TestGoldenHelper(GoldenTestCase):
    """The comparison helper itself (no compile)."""

    def setUp(self):
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.golden_dir = Path(self.tmp.name)
        self.accept = os.environ.pop("EXPECTTEST_ACCEPT", None)
        self.module_accept = getattr(expecttest, "ACCEPT", None)
        expecttest.ACCEPT = None

    def tearDown(self):
        if self.accept is not None:
            os.environ["EXPECTTEST_ACCEPT"] = self.accept
        expecttest.ACCEPT = self.module_accept
        self.tmp.cleanup()

    def test_mismatch_shows_a_unified_diff(self):
        (self.golden_dir / "g.txt").write_text("a\nb\nc\n")
        with self.assertRaises(AssertionError) as cm:
            self.assertGolden("g", "a\nB\nc\n")
        msg = str(cm.exception)
        self.assertIn("graph differs from golden g.txt", msg)
        self.assertIn("--- golden/g.txt", msg)
        self.assertIn("-b\n+B\n", msg)
        self.assertIn("EXPECTTEST_ACCEPT=1", msg)

    def test_renumbering_is_blanked_in_the_first_diff(self):
        (self.golden_dir / "g.txt").write_text("v0 = a\nv1 = b(v0)\nv2 = c(v1)\n")
        with self.assertRaises(AssertionError) as cm:
            self.assertGolden("g", "v0 = a\nv1 = x\nv2 = b(v0)\nv3 = c(v2)\n")
        msg = str(cm.exception)
        short = msg.split("full diff:")[0]
        self.assertIn("node numbers blanked", short)
        changes = [x for x in short.splitlines()
                   if x[:1] in ("+", "-") and x[:3] not in ("+++", "---")]
        self.assertEqual(changes, ["+v# = x"])

    def test_missing_golden_fails(self):
        with self.assertRaisesRegex(AssertionError, "does not exist"):
            self.assertGolden("nope", "x\n")

    def test_accept_rewrites(self):
        os.environ["EXPECTTEST_ACCEPT"] = "1"
        try:
            self.assertGolden("new", "x\n")
        finally:
            del os.environ["EXPECTTEST_ACCEPT"]
        self.assertEqual((self.golden_dir / "new.txt").read_text(), "x\n")
        self.assertGolden("new", "x\n")


class TestGraphText(expecttest.TestCase):
    """graph_text on hand-built graphs (no compile)."""

    def test_names_views_and_symbols(self):
        import sympy
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        env = ShapeEnv()
        s52, s7 = (env.create_symintnode(sympy.Symbol(n, positive=True, integer=True), hint=4)
                   for n in ("s52", "s7"))
        g = torch.fx.Graph()
        t, x, w, b = (g.placeholder(f"arg{i}_1") for i in range(4))
        t.meta["val"] = s52
        h = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
        h.meta["val"] = s7 * s52  # printed in order of first appearance: s52 -> s0, s7 -> s1
        r = g.call_function(torch.ops.aten.relu.default, (h,))
        mix = g.call_function(torch.ops.kimi.attn_res_mix.default, (r, b, w, w, 1, 1e-6))
        item = g.call_function(operator.getitem, (r, 0))
        g.output((mix, item))
        self.assertExpectedInline(graph_text(g, names=["T", "x", "w", "bank"]), """\
input s0: Sym(s0)
input x
input w
input bank
v0: Sym(s0*s1) = aten.mul.Tensor(x, 2.0)
v1 = aten.relu(v0)
v2 = kimi.attn_res_mix(v1, bank, w, w, 1, 1e-06)
v1[0]
return (v2, v1[0])
""")
        self.assertExpectedInline(graph_text(g, "skeleton"), """\
input in2
input in3
... 2 more inputs
... 1 ops
v0 = aten.relu(_)
v1 = kimi.attn_res_mix(v0, in3, in2, in2, 1, 1e-06)
v0[0]
return (v1, v0[0])
""")

    def test_kimi_view_names_each_argument_by_its_producer(self):
        """Views of an input or a kimi output collapse to one view(...); a view of a computed
        value prints as that value's op (releases move reshapes around computations);
        casts keep their dtype; the model's own outputs print as ``...``."""
        aten = torch.ops.aten
        g = torch.fx.Graph()
        x, w, bank = (g.placeholder(n) for n in ("x", "w", "bank"))
        qk = g.call_function(aten.reshape.default, (g.call_function(aten.t.default, (w,)), [-1]))
        h = g.call_function(aten.view.default, (g.call_function(aten.mm.default, (x, w)), [4, 8]))
        mix = g.call_function(torch.ops.kimi.attn_res_mix.default, (h, bank, w, qk, 1, 1e-6))
        cast = g.call_function(torch.ops.prims.convert_element_type.default,
                               (g.call_function(aten.clone.default, (mix,)), torch.bfloat16))
        mix2 = g.call_function(torch.ops.kimi.attn_res_mix.default, (cast, bank, w, w, 0, 1e-6))
        out = g.call_function(aten.relu.default, (mix2,))
        g.output((out, mix, g.call_function(aten.alias.default, (mix2,))))
        self.assertExpectedInline(graph_text(g, "kimi", names=["x", "w", "bank"]), """\
k0 = kimi.attn_res_mix(aten.mm(x, w), bank, w, view(w), 1, 1e-06)
k1 = kimi.attn_res_mix(to(bf16, view(k0)), bank, w, w, 0, 1e-06)
return (..., k0, view(k1))
""")

    def test_unknown_view(self):
        with self.assertRaisesRegex(ValueError, "unknown view 'short'"):
            graph_text(torch.fx.Graph(), "short")

    def test_op_lists_name_every_kimi_op(self):
        """kimi_op_counts and the DOT colours cover every registered kimi op (no stale list)."""
        self.assertEqual(sorted(KIMI_OPS), sorted(torch.ops.kimi))
        self.assertLessEqual(set(MIXTURE_OPS), set(KIMI_OPS))
