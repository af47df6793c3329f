"""The prefix pass under a name vLLM resolves (``inductor_passes``).

The name: ``"kimi_passes.prefix_stream_pass.prefix_stream_pass"``.

Invariant: importing this module makes it ``kimi_passes.vllm.prefix_stream_pass`` (the
``KimiVllmPass`` of stream prefix, default options), so the import system binds that
pass as ``kimi_passes.prefix_stream_pass``, which is where vLLM reads the name above
from. Why a module per stream, and why the name is doubled: ``kimi_passes.vllm.compile_pass``,
"Names vLLM resolves". Imports vLLM.
"""

import sys

from kimi_passes.vllm.compile_pass import prefix_stream_pass

sys.modules[__name__] = prefix_stream_pass  # what the import binds on kimi_passes
