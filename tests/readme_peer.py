"""One peer process running the README's "own JAX code" block as written.

``python -m tests.readme_peer OUT_DIR ADDRS TARGET EPOCHS SEED [BLOCK]``: runs the block
(BLOCK: "own", the default, or "diloco": the DiLoCo section's) with the placeholder address
replaced by ``ADDRS`` (a JSON list) and the target by ``TARGET``, and
supplies the three names it leaves to the user: ``params`` (a linear model's weights, zeros),
``loss_fn`` (mean squared error) and ``batches`` (micro-batches of 4 until the collaboration
reached ``EPOCHS``, each taking ``$README_PEER_PACE`` seconds of "compute"). Every micro-batch
it feeds is appended to ``OUT_DIR/fed.jsonl`` with the epoch of the state it was fed to
(followed by ``{"carried": true}`` when a round that began during its micro-step carried it
over to the next epoch: ``collaborative``'s hand-over), flushed at once (a killed peer
leaves what it fed); at the end ``OUT_DIR/final.npz`` holds the parameters and the epoch,
and ``history.json`` the averaging steps (group size, complete) this process took;
``peer.json`` its peer id and the peers it banned (``dedloc_jax.bans``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

import dedloc_jax
from dedloc_jax import CollaborativeState
from dedloc_jax.state.training import collaboration_state

README = Path(__file__).resolve().parent.parent / "README.md"
PLACEHOLDER = '["/ip4/1.2.3.4/tcp/31337/p2p/..."]'
MICRO = 4
PACE = float(os.environ.get("README_PEER_PACE", "0.005"))  # seconds of "compute" per batch
TRUE_W = np.arange(1, 6, dtype=np.float32)


# The README's blocks this peer can run: heading, and the target as written there.
BLOCKS = {
    "own": ("Train with a collaboration from your own JAX code", "target_batch_size=4096"),
    "diloco": ("Low-communication training (DiLoCo)", "target_batch_size=500 * 4096"),
}


def example(block: str = "own") -> str:
    """The README's block, exactly as a user copies it."""
    heading, target = BLOCKS[block]
    text = README.read_text()
    found = re.search(rf"## {re.escape(heading)}\n\n```python\n(.*?)```", text, re.S)
    assert found, f"README.md lost its {heading!r} example"
    code = found.group(1)
    assert PLACEHOLDER in code and target in code
    return code


def loss_fn(params: dict, batch: dict) -> jnp.ndarray:
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _carried(opt_state: Any, fed_to: int) -> bool:
    """Whether the micro-batch fed at epoch ``fed_to`` went into the next epoch's accumulator:
    the round of ``fed_to`` began during its micro-step, and the state moved on holding it."""
    s = collaboration_state(opt_state)
    return isinstance(s, CollaborativeState) and int(s.epoch) > fed_to and int(s.samples) > 0


def main(
    out: Path, addrs: list[str], target: int, epochs: int, seed: int, block: str = "own"
) -> None:
    namespace: dict[str, Any] = {}
    rng = np.random.default_rng(seed)
    fed = (out / "fed.jsonl").open("a")

    def batches():
        deadline = time.monotonic() + 240
        last = None  # the epoch the last micro-batch was fed to
        while time.monotonic() < deadline:
            state = namespace.get("opt_state")
            epoch = dedloc_jax.collaboration_epoch(state) if state is not None else 0
            if last is not None and _carried(state, last):
                fed.write(json.dumps({"carried": True}) + "\n")
            if epoch >= epochs:
                return
            x = rng.normal(size=(MICRO, TRUE_W.size)).astype(np.float32)
            y = x @ TRUE_W
            fed.write(
                json.dumps({"epoch": epoch, "t": time.time(), "x": x.tolist(), "y": y.tolist()})
                + "\n"
            )
            fed.flush()
            last = epoch
            time.sleep(PACE)  # a micro-step of a small real model
            yield {"x": x, "y": y}

    code = example(block).replace(PLACEHOLDER, repr(addrs))
    code = code.replace(BLOCKS[block][1], f"target_batch_size={target}")
    namespace.update(
        params={"w": jnp.zeros(TRUE_W.size, jnp.float32)}, loss_fn=loss_fn, batches=batches()
    )
    exec(compile(code, str(README), "exec"), namespace)
    state = namespace["opt_state"]
    np.savez(
        out / "final.npz",
        w=np.asarray(namespace["params"]["w"]),
        epoch=np.int64(dedloc_jax.collaboration_epoch(state)),
    )
    core = namespace["collab"].core  # kept by the closed collaboration
    (out / "history.json").write_text(json.dumps([h.to_dict() for h in core.history]))
    me = {"peer_id": str(core.node.peer_id), "bans": core.bans.listing()}
    (out / "peer.json").write_text(json.dumps(me))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out_dir, addrs_json, target_s, epochs_s, seed_s, *block = sys.argv[1:]
    main(Path(out_dir), json.loads(addrs_json), int(target_s), int(epochs_s), int(seed_s), *block)
