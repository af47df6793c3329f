"""``python -m kimi_passes vllm-plan``: what a ``vllm serve`` command would do with Kimi K3.

``command`` resolves the command line through vLLM's own config code and the K3 route's
startup (``kimi_passes.vllm.k3``: the stream, the serving plan, the drafter's capture
ids); ``platform`` stands vLLM's platform in for a GPU the machine lacks, so a CPU machine
resolves the config the GPU server will. Importing this package imports neither module.
"""
