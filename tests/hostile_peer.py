"""A hostile trainer process for the real-process tests: :mod:`tests.readme_peer` (same
arguments), except that every share it reduces for its group comes back as -1000 x the
aggregate (issue 46's lying reducer). The lie is patched in here, in the child process only:
production code has no switch for it.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np

from dedloc_jax.averaging.reducer import Reducer
from tests import readme_peer

LIE = np.float32(-1000.0)


def lie() -> None:
    honest = Reducer._aggregate

    def lying(self: Reducer, k: int, avg: np.ndarray) -> None:
        honest(self, k, avg)
        avg *= LIE

    Reducer._aggregate = lying  # type: ignore[method-assign]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out_dir, addrs_json, target_s, epochs_s, seed_s = sys.argv[1:]
    lie()
    readme_peer.main(
        Path(out_dir), json.loads(addrs_json), int(target_s), int(epochs_s), int(seed_s)
    )
