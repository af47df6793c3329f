"""Preloaded by the forkserver that starts tests/test_distributed_stages.py's ranks: each
rank is forked with Inductor set up as the cross-process tests' children are
(tests/helpers/process.py ``INDUCTOR_SETUP``), instead of setting it up again at the start
of its first compile."""

from helpers.process import INDUCTOR_SETUP, set_up

set_up(INDUCTOR_SETUP)
