"""Training graphs: AttnRes mixing fused before AOTAutograd, so that the forward graph calls
the kimi mix ops and the backward graph their backward ops (docs/design.md section 7).

- ``trace``: Dynamo's graph traced to a functional ATen graph below autograd;
- ``pre_autograd``: when a graph needs a backward, and the fusion run on the traced graph
  (or the refusal, with its reason, that leaves it unfused).
"""

from kimi_passes.training.pre_autograd import fuse_before_autograd, needs_autograd

__all__ = ["fuse_before_autograd", "needs_autograd"]
