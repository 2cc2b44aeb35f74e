"""Fresh ``bytes`` objects the secure channel decrypts big frames into, without zero-filling.

Why: ``AESGCM.decrypt`` / ``ChaCha20Poly1305.decrypt`` zero the new bytes object before writing
the plaintext into it, one more pass over every received megabyte (in interleaved runs of the
transport bench about a tenth of the receiver's CPU). CPython can make a bytes object whose
contents are not yet written (``PyBytes_FromStringAndSize(NULL, n)``, what its own C code does
before filling one); :func:`fresh_bytes` returns such an object with a writable view of its
storage, into which ``decrypt_into`` writes the plaintext. The view is released before the
object is handed on, and nothing can have seen the object (or hashed it) before that.

Where this is not CPython, or the layout check at import fails, :data:`AVAILABLE` is False and
the channel decrypts the usual way.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

MIN_BYTES = 2  # CPython shares its 0-byte object: never hand that one out for writing
_DATA_OFFSET = bytes.__basicsize__ - 1  # offset of ob_sval in PyBytesObject
_new_bytes = None


def fresh_bytes(n: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` of length ``n`` (unwritten) and a writable view of its storage.

    The caller fills the whole view, releases it, and only then lets the bytes object go.
    """
    if n < MIN_BYTES or _new_bytes is None:
        raise ValueError(f"fresh_bytes needs n >= {MIN_BYTES} on CPython (got {n})")
    obj = _new_bytes(None, n)
    storage = (ctypes.c_char * n).from_address(id(obj) + _DATA_OFFSET)
    return obj, memoryview(storage).cast("B")


def _setup() -> bool:
    global _new_bytes
    if sys.implementation.name != "cpython":
        return False
    try:
        make = ctypes.pythonapi.PyBytes_FromStringAndSize
    except AttributeError:
        return False
    make.restype = ctypes.py_object
    make.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
    _new_bytes = make
    pattern = bytes(range(97, 97 + 26))
    obj, view = fresh_bytes(len(pattern))
    view[:] = pattern
    view.release()
    if obj != pattern or len(obj) != len(pattern):
        _new_bytes = None
        logger.info("bytes layout not as expected: decrypting into zeroed buffers")
        return False
    return True


AVAILABLE = _setup()
