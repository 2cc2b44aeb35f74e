"""Real peer processes on loopback (slow: each process imports JAX and starts a node)."""

import pytest

from bench.allreduce import run_loopback


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_three_processes_with_a_client_agree_bit_for_bit(codec):
    result = run_loopback(peers=3, size=300_000, clients=1, codec=codec, rounds=1)
    assert result["identical"]
    assert result["max_abs_error"] < (1e-5 if codec == "none" else 5e-3)
