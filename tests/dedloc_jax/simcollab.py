"""The simulated-collaboration helpers, kept importable from here for the tests."""

from dedloc_jax.testing import (
    matchmakers,
    open_sim_attacker,
    open_sim_collaboration,
    open_sim_dhts,
)

__all__ = ["matchmakers", "open_sim_attacker", "open_sim_collaboration", "open_sim_dhts"]
