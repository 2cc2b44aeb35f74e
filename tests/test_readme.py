"""The README's "own JAX code" example runs as written: two peers on loopback train with it.

Users copy that block first; a name it forgets to import or an API it calls wrongly is the
first thing they meet. The test takes the block from README.md, changes only the placeholder
address (to a live peer's) and the target batch (4096 to 32), supplies the three names the
README leaves to the user (``params``, ``loss_fn``, ``batches``) and runs it in two threads.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

import dedloc_jax

README = Path(__file__).resolve().parent.parent / "README.md"
PLACEHOLDER = '["/ip4/1.2.3.4/tcp/31337/p2p/..."]'
EPOCHS = 3
TRUE_W = np.arange(1, 6, dtype=np.float32)


def _example() -> str:
    text = README.read_text()
    found = re.search(
        r"## Train with a collaboration from your own JAX code\n\n```python\n(.*?)```", text, re.S
    )
    assert found, "README.md lost its 'own JAX code' example"
    code = found.group(1)
    assert PLACEHOLDER in code and "target_batch_size=4096" in code
    return code


def _loss_fn(params: dict, batch: dict) -> jnp.ndarray:
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _run_peer(code: str, seed: int, out: dict[int, Any]) -> None:
    namespace: dict[str, Any] = {}
    rng = np.random.default_rng(seed)

    def batches():
        """Micro-batches of 8 until this peer's collaboration has made EPOCHS steps."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = namespace.get("opt_state")
            if state is not None and dedloc_jax.collaboration_epoch(state) >= EPOCHS:
                return
            x = rng.normal(size=(8, TRUE_W.size)).astype(np.float32)
            yield {"x": x, "y": x @ TRUE_W}

    namespace.update(
        params={"w": jnp.zeros(TRUE_W.size, jnp.float32)}, loss_fn=_loss_fn, batches=batches()
    )
    try:
        exec(compile(code, str(README), "exec"), namespace)
    except BaseException as e:  # re-raised in the test's thread
        out[seed] = e
        return
    out[seed] = (namespace["params"], namespace["opt_state"])


def test_readme_example_trains_two_peers_in_step() -> None:
    first = dedloc_jax.Collaboration("my-run")
    first.start()
    try:
        code = _example().replace(PLACEHOLDER, repr([str(a) for a in first.addrs]))
        code = code.replace("target_batch_size=4096", "target_batch_size=32")
        out: dict[int, Any] = {}
        threads = [threading.Thread(target=_run_peer, args=(code, s, out)) for s in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        first.close()
    for result in out.values():
        if isinstance(result, BaseException):
            raise result
    assert sorted(out) == [0, 1], "a peer did not finish"
    (p0, s0), (p1, s1) = out[0], out[1]
    assert dedloc_jax.collaboration_epoch(s0) == dedloc_jax.collaboration_epoch(s1) == EPOCHS
    # Everyone applied the same averaged steps, and they moved the weights toward TRUE_W.
    np.testing.assert_array_equal(np.asarray(p0["w"]), np.asarray(p1["w"]))
    assert np.all(np.sign(np.asarray(p0["w"])) == 1.0)
