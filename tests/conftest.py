"""Test-session settings shared by every test and the processes tests start.

XLA compiles at backend optimisation level 0 here: the suite's models are tiny, so compiling
dominates their run time and level 0 compiles them about a third faster; every process a test
starts inherits the setting, so results that must be bit-identical across peers still are.
Set ``XLA_FLAGS`` yourself to test with other flags.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
