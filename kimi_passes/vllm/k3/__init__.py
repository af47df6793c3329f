"""The K3 route: vLLM's own Kimi K3 forward serves the aux stream, vLLM's files untouched.

vLLM calls ``route.register`` (the ``vllm.general_plugins`` entry point ``kimi_passes``)
in every process. The modules, in the order a K3 process meets them:

1. ``route.register``: our variable and vLLM's flag checked (a bad value raises), the
   process's route built (``route.EagerRoute``, by ``route._process_route`` alone), the
   import hook armed; nothing else;
2. ``hook``: when vLLM imports one of its K3 model modules, the route wraps that module's
   ``KimiLinearModel.__init__`` (``route.checked_init``); no other import is touched;
3. at the first K3 model's init, ``stream`` resolves the process's stream once: our
   variable, vLLM's flag, the served drafter's declaration (two that disagree: refused);
4. when a source asks for one, ``surface`` refuses a vLLM whose K3 changed what the route
   relies on; then ``route`` rebinds vLLM's ``attn_res`` (``vllm_attn_res``: the kimi ops)
   and wraps the model's capture method, ``forward`` and ``_set_aux_hidden_state_layers``;
5. ``eager``: in eager K3 each capture is read out of its consumer's ``attn_res`` call, per
   thread; traced by Dynamo, the captures stay vLLM's and ``compile_pass`` rewrites them;
6. ``plan``: vLLM's resolved config is served (a ``ServingPlan``, logged, kept on the
   model) or refused with the fix, before the first request.

Invariant: importing this package or any module in it imports no vLLM module (vLLM's code
is reached at a K3 model's init, when vLLM is importing it anyway); this file imports
nothing. ``route.unroute_attn_res`` puts back every name the route replaced. ``vllm_plan``
runs steps 3 and 6 for a ``vllm serve`` command line. docs/design.md section 11.
"""
