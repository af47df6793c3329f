"""The GPU window: every CUDA figure of kimi_passes from one device call.

One entry, ``python -m tools.gpu`` (:mod:`.__main__`), with four commands:

``prepare``          on the CPU machine: ``.gpu_carry/`` (:mod:`.prepare`)
``check``            on the GPU: the steps in order, under one budget (:mod:`.runner`)
``info``             the check's first step: can this machine run it? (:mod:`.info`)
``fill-benchmarks``  BENCHMARKS.md's CUDA tables from a results.json (:mod:`.report`)

``bash tools/gpu_prepare.sh`` and ``bash tools/gpu_check.sh`` wrap ``prepare`` and
``check``. The steps are :mod:`.steps` (one line each); the CUDA tests a step runs are the
tests marked ``@pytest.mark.gpu_check("<shard>")`` (tests/helpers/gpu_marker.py). Two steps are
modules of their own: :mod:`.eager_route` (the eager route driving the reference K3) and
:mod:`.vllm_k3` (vLLM's own K3 forward against the kimi pass). Nothing here imports
from tests/; the steps run the project's own modules, pytest and the bench.
"""
