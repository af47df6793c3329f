"""The package's layout: no import cycles, one tree per process, a wheel that carries it all.

- The import graph of ``kimi_passes`` (``ops/`` and ``graphs/`` as ``kimi_passes.ops`` /
  ``kimi_passes.graphs``) has no cycle, counting imports inside functions and
  ``TYPE_CHECKING`` blocks; the detector itself is checked on a tree with a cycle.
- Two checkouts, one installed editable (the README's set-up), code run from the other:
  every module comes from the tree ``kimi_passes`` came from, and a module that tree lacks
  is an error naming it, never the other checkout's copy. A checkout run with no install at
  all works the same; ``kimi_passes/`` alone, with no ``ops/`` beside it, is refused with
  the remedy.
- A wheel built from the tree (not the editable install) carries every package and the
  golden files, and imports from where it was installed.
- The house bounds: every package module and every tool (tools/**.py) at most 450 lines,
  no function over 60 lines but a Triton kernel. The docs have no line bound: they are
  written for their readers.
- The README: its first screen shows the three commands a user runs (set-up and the main
  job, the tests, a K3 user's ``vllm serve`` with its drafter); its Layout maps the tree.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from helpers.readme import bash_lines

ROOT = Path(__file__).resolve().parent.parent
#: Import name -> folder: the package-dir mapping of pyproject.toml.
TREES = {"kimi_passes": ROOT / "kimi_passes", "kimi_passes.ops": ROOT / "ops",
         "kimi_passes.graphs": ROOT / "graphs"}


# --------------------------------------------------------------------------- import cycles


def module_files(trees: dict[str, Path]) -> dict[str, Path]:
    """Module name -> source file for every ``.py`` file under ``trees``."""
    mods = {}
    for pkg, root in trees.items():
        for f in sorted(root.rglob("*.py")):
            parts = [p for p in f.relative_to(root).with_suffix("").parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = f
    return mods


def packages_run_by(target: str, importer: str, mods: dict[str, Path]) -> set[str]:
    """The package ``__init__`` modules that importing ``target`` from ``importer`` runs.

    Importing ``a.b.c`` runs ``a`` and ``a.b`` first; the packages ``importer`` itself
    lives in have run (or are running) already, so they add no edge.
    """
    own = importer.split(".")
    parts = target.split(".")
    found = set()
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg in mods and parts[:i] != own[:i]:
            found.add(pkg)
    return found


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (any scope; ``from p import m`` names p.m),
    and the package ``__init__`` modules each import runs on the way."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs or [base]
            found = {t for t in targets if t in mods}
            for t in list(found):
                found |= packages_run_by(t, m, mods)
            edges[m] |= found - {m}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first search meets (each as a path that returns to its start)."""
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return found


def test_the_package_has_no_import_cycles():
    mods = module_files(TREES)
    assert {"kimi_passes.backend", "kimi_passes.ops.library", "kimi_passes.graphs.k3",
            "kimi_passes.fusion.rules"} <= set(mods)
    found = cycles(import_graph(mods))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_detector_sees_a_cycle(tmp_path):
    """Including one through a TYPE_CHECKING import and a relative one."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    found = cycles(import_graph(module_files({"pkg": pkg})))
    assert [c for c in found if set(c) == {"pkg.a", "pkg.b"}], found


def test_the_cycle_detector_sees_a_cycle_through_a_package_init(tmp_path):
    """``c`` imports ``sub.y`` only, but that runs ``sub/__init__``, which imports ``sub.x``,
    which imports ``c`` (inside a function: the usual dodge)."""
    sub = tmp_path / "pkg" / "sub"
    sub.mkdir(parents=True)
    (sub.parent / "__init__.py").write_text("")
    (sub / "__init__.py").write_text("from pkg.sub.x import X\n")
    (sub / "x.py").write_text("X = 1\ndef f():\n    import pkg.c\n")
    (sub / "y.py").write_text("Y = 2\n")
    (sub.parent / "c.py").write_text("from pkg.sub.y import Y\n")
    found = cycles(import_graph(module_files({"pkg": sub.parent})))
    assert [c for c in found if set(c) == {"pkg.c", "pkg.sub", "pkg.sub.x"}], found
    # A module inside the package does not run its own package's __init__ again.
    edges = import_graph(module_files({"pkg": sub.parent}))
    assert "pkg.sub" not in edges["pkg.sub.x"] and "pkg.sub" in edges["pkg.c"]


# --------------------------------------------------------------------------- one tree

PROBE = """
import importlib, json, sys
if {strip}:  # no install at all: drop the editable install's finder
    sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in repr(f)]
out = {{}}
for name in {names!r}:
    try:
        out[name] = importlib.import_module(name).__file__
    except ImportError as e:
        out[name] = f"{{type(e).__name__}}: {{e}}"
print(json.dumps(out))
"""
NAMES = ("kimi_passes", "kimi_passes.ops", "kimi_passes.ops.cpu", "kimi_passes.graphs",
         "kimi_passes.graphs.k3", "kimi_passes.fusion", "kimi_passes.taps.aux_stream",
         "kimi_passes.bench")


def probe(cwd: Path, names=NAMES, strip=False, env=None) -> dict[str, str]:
    """Import ``names`` in a fresh interpreter run from ``cwd`` (``-c``: cwd first on sys.path)."""
    r = subprocess.run([sys.executable, "-c", PROBE.format(names=names, strip=strip)],
                       cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def copy_checkout(dest: Path, parts=("kimi_passes", "ops", "graphs")) -> Path:
    dest.mkdir()
    for part in parts:
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    return dest


def editable_root() -> Path | None:
    """The checkout this environment's editable install of kimi-passes maps, if any."""
    # Every kimi-passes distribution on sys.path: the editable install writes
    # kimi_passes.egg-info into the checkout, and pytest run from its root finds that
    # one first (no direct_url.json); the installed one is in site-packages.
    for dist in metadata.distributions(name="kimi-passes"):
        text = dist.read_text("direct_url.json")
        info = json.loads(text) if text else {}
        if info.get("dir_info", {}).get("editable"):
            return Path(info["url"].removeprefix("file://")).resolve()
    return None


def under(path: str, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root)


@pytest.fixture(scope="module")
def other_checkout(tmp_path_factory) -> Path:
    """A second checkout, B, while this one (A) is installed editable."""
    if editable_root() != ROOT:
        pytest.skip(f"needs {ROOT} installed editable (the README's set-up command)")
    return copy_checkout(tmp_path_factory.mktemp("b") / "checkout")


def test_code_run_from_another_checkout_imports_that_checkout(other_checkout):
    got = probe(other_checkout)
    assert all(under(f, other_checkout) for f in got.values()), got


def test_a_module_the_other_checkout_lacks_is_not_taken_from_the_installed_one(other_checkout,
                                                                             tmp_path):
    """The editable install's finder would serve A's copy of any direct submodule of
    kimi_passes, kimi_passes.ops or kimi_passes.graphs that B lacks."""
    b = copy_checkout(tmp_path / "b2")
    shutil.rmtree(b / "kimi_passes" / "bench")
    (b / "ops" / "triton_kernels.py").unlink()  # imported lazily, on first launch
    got = probe(b, ("kimi_passes.bench", "kimi_passes.ops.triton_kernels", "kimi_passes.fusion"))
    for name, folder in (("kimi_passes.bench", b / "kimi_passes"),
                         ("kimi_passes.ops.triton_kernels", b / "ops")):
        assert got[name].startswith(f"ModuleNotFoundError: No module named {name!r}"), got
        assert str(folder) in got[name], got
    assert under(got["kimi_passes.fusion"], b), got


def test_the_installed_checkout_serves_other_directories(tmp_path):
    root = editable_root()
    if root is None:
        pytest.skip("needs the checkout installed editable (the README's set-up command)")
    got = probe(tmp_path)
    assert all(under(f, root) for f in got.values()), got


def test_a_checkout_runs_with_no_install(tmp_path):
    b = copy_checkout(tmp_path / "b")
    got = probe(b, strip=True)
    assert all(under(f, b) for f in got.values()), got


def test_the_package_folder_alone_is_refused_with_the_remedy(tmp_path):
    c = copy_checkout(tmp_path / "c", parts=("kimi_passes",))
    got = probe(c, ("kimi_passes",), strip=True)
    msg = got["kimi_passes"]
    assert msg.startswith("ImportError: kimi_passes.ops cannot be found"), msg
    assert "pip install -e ." in msg and str(c / "kimi_passes") in msg, msg


# --------------------------------------------------------------------------- the wheel


def test_a_built_wheel_carries_every_package_and_imports_from_where_it_lies(tmp_path):
    src = copy_checkout(tmp_path / "src")  # setuptools writes build files next to the sources
    (src / "README.md").write_bytes((ROOT / "README.md").read_bytes())
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("kimi_passes-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # Every package folder of the tree is in the wheel (pyproject's list is complete).
    packages = sorted(m for m, f in module_files(TREES).items() if f.name == "__init__.py")
    for pkg in packages:
        assert pkg.replace(".", "/") + "/__init__.py" in names, f"{pkg} not in {wheel.name}"
    goldens = sorted(p.name for p in (ROOT / "graphs" / "golden").glob("*.txt"))
    assert goldens and all(f"kimi_passes/graphs/golden/{g}" in names for g in goldens)
    assert "kimi_passes/ops/cpu_rows.c" in names  # the C kernel builds from the installed source

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**__import__("os").environ, "PYTHONPATH": str(site)}
    got = probe(tmp_path, (*NAMES, *packages), strip=True, env=env)
    assert all(under(f, site) for f in got.values()), got


# --------------------------------------------------------------------------- public names


#: Every public import: module -> the names users import from it (README, docs/, the
#: subpackages' ``__all__``). A name leaves this list only in a commit that says why.
PUBLIC = {
    "kimi_passes": [
        "AuxCaptureError", "AuxStreamPass", "DrafterTaps", "KimiBackend", "KimiPassConfig",
        "KimiPassManager", "aux_tap", "drafter_capture_ids", "graph_text", "kimi_backend",
        "make_kimi_backend", "ops", "pass_manager"],
    "kimi_passes.backend": ["KimiBackend", "kimi_backend", "make_kimi_backend"],
    "kimi_passes.config": [
        "ENV_VAR", "OPTIONS", "STREAMS", "DrafterTaps", "KimiPassConfig", "drafter_capture_ids",
        "resolve_aux_stream"],
    "kimi_passes.pipeline": ["pass_manager"],
    "kimi_passes.fx.manager": ["KimiPassManager", "PassObserver"],
    "kimi_passes.taps": [
        "STREAMS", "AuxStreamPass", "DrafterTaps", "TapRewrite", "aux_tap",
        "drafter_capture_ids", "resolve_aux_stream"],
    "kimi_passes.fusion": [
        "DEBUG_ENV", "AttnResFusionPass", "FusedSite", "NearMiss", "NoMatch", "debug_enabled"],
    "kimi_passes.training": ["fuse_before_autograd", "needs_autograd"],
    "kimi_passes.lowering": ["LowerKimiOps"],
    "kimi_passes.quant": ["FuseQuantPass", "QuantFusion", "QuantParams", "QuantSite",
                          "find_quants"],
    "kimi_passes.debug": ["compat_load_by_key_path", "dump", "pass_dumps"],
    "kimi_passes.debug.recording": ["GraphRecorder", "graph_caches_off"],
    "kimi_passes.graphs": ["K3Config", "K3Model", "attn_res_torch", "fp8_per_token"],
    "kimi_passes.graphs.k3": ["K3Config", "K3Model"],
    "kimi_passes.ops": [
        "AttnResArgumentError", "attn_res", "attn_res_capture",
        "attn_res_capture_differentiable", "attn_res_capture_triton", "attn_res_differentiable",
        "attn_res_mix", "attn_res_mix_reference", "attn_res_mix_triton", "attn_res_quant",
        "attn_res_quant_capture", "attn_res_quant_capture_triton", "attn_res_quant_triton",
        "attn_res_reference", "attn_res_triton", "aux_tap_op", "quant_fp8_constants"],
    "kimi_passes.bench": ["main", "bench_op", "bench_tap", "bench_pass", "bench_compile",
                          "bench_quant"],
    # Imports no vLLM module (the vllm.general_plugins entry point); EagerRoute, current
    # and serve_eager: the route's state and its public hook (tools/gpu/eager_route.py).
    "kimi_passes.vllm.k3.route": ["EagerRoute", "current", "register", "route_attn_res",
                                  "serve_eager", "unroute_attn_res", "vllm_attn_res",
                                  "vllm_attn_res_amd"],
}
#: Needs vLLM (skipped without it).
PUBLIC_VLLM = {"kimi_passes.vllm": [
    "KimiVllmPass", "attn_res_stream_pass", "compile_config_entries",
    "make_vllm_pass", "prefix_stream_pass"]}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_what_users_import_keeps_working(module):
    import importlib

    mod = importlib.import_module(module)
    missing = [n for n in PUBLIC[module] if getattr(mod, n, None) is None]
    assert not missing, f"{module} lost {missing}"
    exported = getattr(mod, "__all__", None)
    if exported is not None and module != "kimi_passes.bench":
        # __all__ is the list: a name added there is public, so it is added here too.
        assert sorted(exported) == sorted(PUBLIC[module]), module


def test_the_old_route_module_warns_and_is_the_new_one(monkeypatch):
    """``kimi_passes.vllm.k3_route``, the route's name before ``k3.route``, kept for one
    release: importing it warns naming the new module, and each name is the same object."""
    import importlib

    new = importlib.import_module("kimi_passes.vllm.k3.route")
    monkeypatch.delitem(sys.modules, "kimi_passes.vllm.k3_route", raising=False)
    with pytest.warns(DeprecationWarning, match=r"import kimi_passes\.vllm\.k3\.route"):
        old = importlib.import_module("kimi_passes.vllm.k3_route")
    assert sorted(old.__all__) == sorted(PUBLIC["kimi_passes.vllm.k3.route"])
    assert all(getattr(old, n) is getattr(new, n) for n in old.__all__)


def test_what_vllm_users_import_keeps_working():
    pytest.importorskip("vllm")
    import kimi_passes
    import kimi_passes.vllm as kv

    for name in PUBLIC_VLLM["kimi_passes.vllm"]:
        assert getattr(kv, name, None) is not None, name
    # Importing the compile pass writes into no other module (the top package included).
    assert not {"attn_res_stream_pass", "prefix_stream_pass"} & set(vars(kimi_passes))


def test_the_public_objects_behave():
    import kimi_passes
    import kimi_passes.debug
    import kimi_passes.fusion
    import kimi_passes.graphs.k3

    assert callable(kimi_passes.graph_text)  # the function, not the module of that name
    assert kimi_passes.fusion.AttnResFusionPass().uuid()
    assert callable(kimi_passes.debug.dump) and callable(kimi_passes.debug.pass_dumps)
    assert isinstance(kimi_passes.pass_manager(), kimi_passes.KimiPassManager)


def test_the_entry_points_name_live_objects():
    """``backend="kimi"`` (torch_dynamo_backends), the ``kimi-passes`` console script and
    vLLM's plugin ``kimi_passes`` (vllm.general_plugins)."""
    import kimi_passes.__main__
    import kimi_passes.backend
    import kimi_passes.vllm.k3.route

    eps = metadata.entry_points()
    (backend,) = [e for e in eps.select(group="torch_dynamo_backends") if e.name == "kimi"]
    assert backend.load() is kimi_passes.backend.kimi_backend
    (script,) = [e for e in eps.select(group="console_scripts") if e.name == "kimi-passes"]
    assert script.load() is kimi_passes.__main__.main
    plugins = [e for e in eps.select(group="vllm.general_plugins") if e.name == "kimi_passes"]
    assert plugins, ("the installed metadata has no vllm.general_plugins entry point "
                     "kimi_passes: reinstall (`pip install -e .`) after pyproject.toml changed")
    assert plugins[0].load() is kimi_passes.vllm.k3.route.register


# --------------------------------------------------------------------------- the options


def test_the_readme_options_list_is_the_records():
    """Each option is documented once, on ``KimiPassConfig``; the README's options list is
    that documentation as generated, between its markers."""
    from kimi_passes.config import OPTIONS, KimiPassConfig

    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- options:")
    body = text[text.index("\n", start) + 1:text.index("<!-- /options -->")].strip()
    assert body == KimiPassConfig.options_doc(), (
        "README's options list differs from KimiPassConfig.options_doc(): paste the "
        "generated one")
    names = [line[3:].split("`")[0] for line in body.splitlines() if line.startswith("- `")]
    assert tuple(names) == OPTIONS


# --------------------------------------------------------------------------- the house bounds

#: The developers' guide's bounds: a module a reader takes in at once, a function read
#: without scrolling. A Triton kernel's body may be longer than a function.
MODULE_LINES, FUNCTION_LINES = 450, 60
#: The README's first screen: the line by which a reader sees the commands they run.
README_FIRST_SCREEN = 40


def bounded_files(part: str) -> list[Path]:
    """``package``: every module of kimi_passes/, ops/ and graphs/; ``tools``: every ``.py``
    under tools/."""
    if part == "package":
        return sorted(module_files(TREES).values())
    return sorted((ROOT / "tools").rglob("*.py"))


def _is_jit(fn: ast.expr) -> bool:
    """``jit``, ``triton.jit``, or a call of either (``@triton.jit(...)``)."""
    fn = fn.func if isinstance(fn, ast.Call) else fn
    return (isinstance(fn, ast.Name) and fn.id == "jit") or (
        isinstance(fn, ast.Attribute) and fn.attr == "jit")


def kernels(tree: ast.Module) -> set[str]:
    """The functions made Triton kernels: decorated with ``jit`` / ``triton.jit``, or passed
    to one (``KERNEL = jit(_kernel)``, the project's spelling: ops/triton_mode.py)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(map(_is_jit, node.decorator_list)):
            found.add(node.name)
        elif (isinstance(node, ast.Call) and _is_jit(node.func) and node.args
              and isinstance(node.args[0], ast.Name)):
            found.add(node.args[0].id)
    return found


def over_bounds(path: Path) -> list[str]:
    """What in ``path`` is over the module and function bounds."""
    source = path.read_text()
    where = path.relative_to(ROOT)
    tree = ast.parse(source, filename=str(path))
    over = []
    lines = len(source.splitlines())
    if lines > MODULE_LINES:
        over.append(f"{where}: {lines} lines (at most {MODULE_LINES}: split the module)")
    exempt = kernels(tree)
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name not in exempt:
            n = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if n > FUNCTION_LINES:
                over.append(f"{where}:{fn.lineno}: {fn.name}() has {n} lines (at most "
                            f"{FUNCTION_LINES}, a Triton kernel aside: split it)")
    return over


@pytest.mark.parametrize("part", ["package", "tools"])
def test_the_house_bounds(part):
    """Every package module (kimi_passes/, ops/, graphs/) and every tool (tools/**.py) at
    most 450 lines, with no function over 60 lines other than Triton kernels."""
    over = [line for f in bounded_files(part) for line in over_bounds(f)]
    if over:
        pytest.fail(f"{part}: over the house bounds:\n" + "\n".join(over), pytrace=False)


def test_the_bounds_see_a_long_function_and_spare_a_kernel(tmp_path, monkeypatch):
    """The checker itself: a long function is reported with its line; a kernel, decorated
    or passed to ``jit``, is not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES))
    src = ("import triton\nfrom m import jit\n\n"
           f"def long():\n{body}\n@triton.jit\ndef decorated():\n{body}\n"
           f"def passed():\n{body}\nKERNEL = jit(passed)\n")
    f = tmp_path / "tools" / "t.py"
    f.parent.mkdir()
    f.write_text(src)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert over_bounds(f) == [f"tools/t.py:4: long() has {FUNCTION_LINES + 1} lines (at most "
                              f"{FUNCTION_LINES}, a Triton kernel aside: split it)"]


# --------------------------------------------------------------------------- the README's map


#: The three commands a reader runs, each a line of a ```bash block in the README's first
#: screen: name -> pattern.
FIRST_SCREEN_COMMANDS = {
    "set-up and the main job": r"^python3 -m venv \.venv && .*\.venv/bin/python -m kimi_passes$",
    "the tests": r"\.venv/bin/python -m pytest\b",
    "a K3 user's `vllm serve` with its drafter": r"\bvllm serve \S+ .*--speculative-config ",
}


def test_the_readme_first_screen_shows_the_three_commands():
    """Within the README's first ``README_FIRST_SCREEN`` lines, in ```bash blocks: the
    set-up with the main job, the tests, and a K3 user's ``vllm serve`` with the drafter's
    ``--speculative-config``."""
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:README_FIRST_SCREEN])
    lines = bash_lines(first)
    missing = [name for name, pattern in FIRST_SCREEN_COMMANDS.items()
               if not any(re.search(pattern, line) for line in lines)]
    assert not missing, (f"README: no command for {missing} in a ```bash block of its first "
                         f"{README_FIRST_SCREEN} lines")


def test_the_first_screen_check_sees_a_missing_command():
    """The checker itself: a command in prose, not a bash block, does not count."""
    text = ("```bash\n.venv/bin/python -m pytest -q\n```\n"
            "run `vllm serve m --speculative-config x`\n")
    lines = bash_lines(text)
    assert lines == [".venv/bin/python -m pytest -q"]
    assert not any(re.search(FIRST_SCREEN_COMMANDS["a K3 user's `vllm serve` with its drafter"],
                             line) for line in lines)


def test_the_readme_layout_maps_the_tree():
    """The README's Layout names every subpackage (kimi_passes/, tests/helpers/, tools/),
    and every package and module of the vLLM plugin (kimi_passes/vllm/)."""
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    vllm = ROOT / "kimi_passes" / "vllm"
    want = [f"{d.name}/" for d in sorted((ROOT / "kimi_passes").iterdir())
            if (d / "__init__.py").is_file()]
    want += [f"{d.name}/" for d in sorted((ROOT / "tools").iterdir())
             if (d / "__init__.py").is_file()]
    want += ["helpers/"] + [f"{d.name}/" for d in sorted(vllm.iterdir())
                            if (d / "__init__.py").is_file()]
    want += [f.name for f in sorted(vllm.rglob("*.py")) if f.name != "__init__.py"]
    missing = [w for w in want if w not in layout]
    assert not missing, f"README's Layout does not name {missing}: add a line for each"


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers/, never in a test module."""
    tests = ROOT / "tests"
    names = {f.stem for f in tests.glob("test_*.py")} | {"conftest"}
    found = []
    for f in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                mods = [node.module]
            else:
                continue
            found += [f"{f.relative_to(tests)}:{node.lineno} imports {m}" for m in mods
                      if m.split(".")[0] in names]
    assert not found, "\n".join(found) + "\n(move what they share to tests/helpers/)"
