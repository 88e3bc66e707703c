"""A test that hangs holding the GIL, as a process group's destroy on PyTorch 2.5 did: run by
tests/test_hang_limit.py (this file's name does not match ``test_*.py``, so the suite does not collect it)."""

import ctypes


def test_hangs_holding_the_gil():
    ctypes.PyDLL(None).sleep(120)  # a C call made through PyDLL keeps the GIL
