"""Helpers the test modules share; no test module imports another.

tests/ is on ``sys.path`` (pytest's rootdir-relative ``prepend`` import mode: tests/ has no
``__init__.py``), so test modules import ``helpers.<module>``. A process started outside
pytest that imports them is given tests/ on ``PYTHONPATH`` (the forkserver of
test_distributed_stages.py, the serving processes of test_vllm.py). vLLM's installed K3
forward on stand-ins is package code, ``kimi_passes.graphs.vllm_k3``: a GPU tool uses it.
"""
