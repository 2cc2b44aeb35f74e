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


# The modules that cross from jitted code to the collaboration, and what builds on them.
_ABOVE_STATE = {
    "dedloc_jax.collaborative",
    "dedloc_jax.diloco",
    "dedloc_jax.host",
    "dedloc_jax.collaboration",
}


def test_state_and_the_tracker_import_no_transform() -> None:
    """``state/`` sits below the transforms: the tracker and every module of ``state/`` load
    without ``collaborative``, ``diloco`` or the host boundary. The package's ``__init__``
    (which re-exports the user API, transforms included) is skipped, so only these modules'
    own imports count."""
    code = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys, types
        pkg = types.ModuleType("dedloc_jax")
        pkg.__path__ = [{str(ROOT / "dedloc_jax")!r}]
        sys.modules["dedloc_jax"] = pkg
        import dedloc_jax.state, dedloc_jax.tracker
        for info in pkgutil.walk_packages(dedloc_jax.state.__path__, "dedloc_jax.state."):
            importlib.import_module(info.name)
        print(" ".join(sorted(sys.modules)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = set(out.stdout.split())
    assert "dedloc_jax.state.keeping" in loaded and "dedloc_jax.tracker" in loaded
    assert not loaded & _ABOVE_STATE, sorted(loaded & _ABOVE_STATE)
