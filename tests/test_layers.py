"""The layering rules of ARCHITECTURE.md, checked on the import graph."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports_after(package_modules: str) -> set[str]:
    code = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys
        for name in {package_modules!r}.split():
            pkg = importlib.import_module(name)
            for info in pkgutil.walk_packages(pkg.__path__, name + "."):
                if info.name.endswith("__main__"):
                    continue
                importlib.import_module(info.name)
        print(" ".join(sorted(m.split(".")[0] for m in sys.modules)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


def test_p2p_never_imports_jax_or_upper_layers() -> None:
    loaded = _imports_after("p2p")
    assert not loaded & {"jax", "jaxlib", "flax", "optax", "dedloc_jax", "models", "examples"}


def test_models_never_imports_the_network_layers() -> None:
    loaded = _imports_after("models")
    assert not loaded & {"p2p", "dedloc_jax", "examples"}


def test_dedloc_jax_never_imports_models_or_examples() -> None:
    loaded = _imports_after("dedloc_jax")
    assert not loaded & {"models", "examples"}
