"""Real pipeline stages on torch.distributed: each rank compiles its stage with kimi_backend.

Like an inference engine: every rank builds its stage of the reference K3
(``K3Model(cfg, start, end)``, same seed), compiles it at start-up on inputs of the
serving shape (a refusal must come then, before any request), agrees with the other
ranks that all compiled (``all_reduce`` of an error flag), then serves one request:
rank 0 embeds the tokens, each rank receives ``(hidden, bank)`` from the previous rank
(fixed, known shapes: ``[T, H]`` and ``[T, NB, H]``), runs, and sends them on. Each rank
writes its taps to a file; the parent asserts they equal the single-process compiled
model's taps (fp32, atol = rtol = 1e-5).

gloo over loopback (``GLOO_SOCKET_IFNAME=lo``), rendezvous through a FileStore in
``tmp_path``, processes started with ``torch.multiprocessing`` (forkserver, the server
having imported this module and set up Inductor (``helpers.rank_preload``), so torch,
kimi_passes and Inductor's set-up happen once, not per rank).
Every wait is bounded: a hang fails the test instead of blocking it.

Every compile (ranks and the single-process reference) uses Inductor's
``fallback_by_default``: the stage graphs and the passes are a full compile's, and no C++
kernel is built (the ranks' start-up is the subject, not codegen).
"""

from __future__ import annotations

import datetime
import multiprocessing.forkserver as forkserver
import os
import sys
import time
import traceback
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.k3 import token_ids as seeded_ids
from helpers.op import OP_TOL

import kimi_passes
from kimi_passes import AuxCaptureError
from kimi_passes.graphs.k3 import K3Config, K3Model

T = 6
JOIN_TIMEOUT_S = 420  # the whole group, compiles included, on a busy 2-core machine
PG_TIMEOUT = datetime.timedelta(seconds=300)

# L=7, S=2. Cuts: 2 ranks [0,4) [4,7); 3 ranks [0,2) [2,5) [5,7). A capture id on a cut
# is served by the rank that owns that layer (the remedy AuxCaptureError names): a
# non-final stage leaves its end id out (``K3Model(capture_ids=...)``). Ranks then hold
# {0,2,3},{4,5,7} (2 ranks) or {0},{2,3,4},{5,7} (3 ranks).
CFG = K3Config(num_layers=7, hidden_size=16, attn_res_block_size=2, num_heads=2,
               intermediate_size=32, vocab_size=64, aux_layer_ids=(0, 2, 3, 4, 5, 7), seed=5)
FP32 = dict(atol=OP_TOL[torch.float32], rtol=OP_TOL[torch.float32])  # the op's tolerance
SPLIT = (0, 2, 5, 7)  # three ranks: layers [0, 2), [2, 5), [5, 7)
# Capture id 2 is the end of rank 0's stage [0, 2), tapped there too (the default):
# refused on rank 0 at start-up; rank 1, which owns layer 2, compiles it.
BOUNDARY_CFG = K3Config(num_layers=4, hidden_size=16, attn_res_block_size=2, num_heads=2,
                        intermediate_size=32, vocab_size=64, aux_layer_ids=(2, 4), seed=5)


def token_ids(cfg: K3Config) -> torch.Tensor:
    return seeded_ids(cfg, T, seed=11)


# --------------------------------------------------------------------------- worker


def own_ids(cfg: K3Config, start: int, end: int) -> tuple[int, ...]:
    """The capture ids a stage serves: those it can see, less its end unless it is last."""
    return tuple(k for k in cfg.aux_layer_ids
                 if start <= k <= end and (k < end or end == cfg.num_layers))


def _worker(rank: int, world: int, cfg: K3Config, bounds: tuple, tmp: str,
            leave_boundary: bool) -> None:
    out_file = os.path.join(tmp, f"rank{rank}.pt")
    result = {"rank": rank, "status": "started"}
    try:
        if "helpers.rank_preload" not in sys.modules:
            raise RuntimeError("the forkserver did not preload helpers.rank_preload: each rank "
                               "would import torch and set up Inductor itself "
                               "(start_forkserver)")
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
        torch.set_num_threads(1)
        torch._inductor.config.compile_threads = 1
        torch._inductor.config.fallback_by_default = True
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=world, timeout=PG_TIMEOUT)
        start, end = bounds[rank], bounds[rank + 1]
        ids = own_ids(cfg, start, end) if leave_boundary else None
        stage = K3Model(cfg, start, end, capture_ids=ids)
        result["capture_ids"] = stage.capture_ids
        H, NB = cfg.hidden_size, stage.bank_slots
        with torch.no_grad():
            compiled = torch.compile(stage, backend=kimi_passes.kimi_backend, fullgraph=True,
                                     dynamic=False)
            # Start-up: compile on inputs of the serving shape, as an engine warms up.
            warm = (token_ids(cfg),) if stage.is_first else (torch.zeros(T, H),
                                                              torch.zeros(T, NB, H))
            failed = torch.zeros(1)
            try:
                compiled(*warm)
            except AuxCaptureError as e:
                result.update(status="refused", error_type=type(e).__name__, error=str(e))
                failed += 1
            dist.all_reduce(failed)
            if failed.item():
                if result["status"] != "refused":
                    result["status"] = "aborted: a peer refused to compile"
                return
            # Serve one request.
            if stage.is_first:
                args = (token_ids(cfg),)
            else:
                hidden, bank = torch.empty(T, H), torch.empty(T, NB, H)
                dist.recv(hidden, src=rank - 1)
                dist.recv(bank, src=rank - 1)
                args = (hidden, bank)
            out, taps = compiled(*args)
            if not stage.is_last:
                hidden, bank = out
                dist.send(hidden.contiguous(), dst=rank + 1)
                dist.send(bank.contiguous(), dst=rank + 1)
            result.update(status="ok", taps=[t.clone() for t in taps])
    except BaseException as e:  # reported to the parent, never swallowed
        result.update(status="error", error_type=type(e).__name__,
                      error=f"{e}\n{traceback.format_exc()}")
        raise
    finally:
        torch.save(result, out_file)
        if dist.is_initialized():
            dist.destroy_process_group()


def start_forkserver(ctx) -> None:
    """Start the forkserver (once per process) with this module and ``helpers.rank_preload``
    imported. The server imports its preload with ``sys.path`` as a fresh interpreter has
    it (Python 3.11 does not apply the parent's) and ignores an ImportError, so it is
    started with this directory on ``PYTHONPATH``; each rank checks it was preloaded."""
    ctx.set_forkserver_preload([__name__, "helpers.rank_preload"])
    path = [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")]
    with mock.patch.dict(os.environ, {"PYTHONPATH": os.pathsep.join(filter(None, path))}):
        forkserver.ensure_running()


def run_group(cfg: K3Config, bounds: tuple, tmp_path, leave_boundary=True) -> list[dict]:
    world = len(bounds) - 1
    ctx = mp.get_context("forkserver")
    start_forkserver(ctx)
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world, cfg, bounds, str(tmp_path), leave_boundary))
             for r in range(world)]
    for p in procs:
        p.start()
    # Wait for all, but stop early when one rank dies (its peers would wait on it).
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    results = []
    for r in range(world):
        f = tmp_path / f"rank{r}.pt"
        results.append(torch.load(f, weights_only=False) if f.exists()
                       else {"rank": r, "status": "no result file"})
    codes = [p.exitcode for p in procs]
    assert not hung and codes == [0] * world, (
        f"ranks failed or hung (limit {JOIN_TIMEOUT_S}s; exit codes {codes}, killed {hung}): "
        f"{results}")
    return results


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def single_process_taps():
    """The one-stage model compiled in this process: capture id -> tap."""
    torch._dynamo.reset()
    model = K3Model(CFG)
    with torch.no_grad(), torch._inductor.config.patch(compile_threads=1,
                                                       fallback_by_default=True):
        compiled = torch.compile(model, backend=kimi_passes.kimi_backend, fullgraph=True,
                                 dynamic=False)
        _, taps = compiled(token_ids(CFG))
        _, truth = model.ground_truth(token_ids(CFG))
    for t, g in zip(taps, truth, strict=True):  # the reference itself is the mixture
        torch.testing.assert_close(t, g, **FP32)
    return dict(zip(model.capture_ids, taps, strict=True))


def test_pipeline_ranks_serve_the_single_process_taps(single_process_taps, tmp_path):
    """Three ranks: a first, a middle and a final stage (two ranks have no middle one)."""
    results = run_group(CFG, SPLIT, tmp_path)
    for r in results:
        assert r["status"] == "ok", f"rank {r['rank']}: {r}"
    gathered = {}
    for r in results:
        for k, tap in zip(r["capture_ids"], r["taps"], strict=True):
            assert k not in gathered, f"capture id {k} served by two ranks"
            gathered[k] = tap
    assert sorted(gathered) == sorted(CFG.aux_layer_ids)
    for k, want in single_process_taps.items():
        torch.testing.assert_close(gathered[k], want, **FP32,
                                   msg=lambda m, k=k: f"capture id {k}: {m}")


def test_boundary_tap_refused_on_its_rank_at_startup(tmp_path):
    results = run_group(BOUNDARY_CFG, (0, 2, 4), tmp_path, leave_boundary=False)
    first, second = results
    assert first["status"] == "refused", first
    assert first["error_type"] == "AuxCaptureError"
    msg = first["error"]
    assert "capture id 2" in msg and "[0, 2)" in msg and "Remedy" in msg, msg
    # Rank 1 owns layer 2: its capture id 2 compiles; it stops because its peer refused.
    assert second["capture_ids"] == (2, 4)
    assert second["status"] == "aborted: a peer refused to compile", second
