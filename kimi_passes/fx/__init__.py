"""What every kimi pass stands on; no graph rewrite of its own.

- ``base``: ``KimiGraphPass``, a post-grad pass that dumps, times and logs itself, with a
  cache-safe ``uuid()``;
- ``manager``: ``KimiPassManager`` (the passes in order as one Inductor custom pass, keyed
  on the options record) and ``PassObserver``;
- ``cache_key``: the sources a pass's ``uuid()`` hashes (its module and every kimi_passes
  module it imports);
- ``host_key``: the refusal to run under a host wrapper whose cache key is not the pass's;
- ``fx_toolkit``: reading and editing post-grad FX graphs (casts, copies, sums, inserts);
- ``functionalized``: ``FunctionalCall``, an ``auto_functionalized`` (v1) / ``_v2`` node's
  arguments and outputs, decoded once for the passes, the debug views and the quant matcher;
- ``match``: ``NoMatch`` and the constant readers the fusion and quant matchers share;
- ``kimi_calls``: the kimi calls of a post-grad graph (``AttnResCall``: a functionalized
  ``attn_res`` call's arguments and outputs; the layer a node was traced in).
"""
