"""A test that hangs holding the GIL, as a process group's destroy on PyTorch 2.5 did: run by
tests/test_hang_limit.py (this file's name does not match ``test_*.py``, so the suite does not collect it)."""

import ctypes


def test_hangs_holding_the_gil():
    ctypes.PyDLL(None).sleep(120)  # a C call made through PyDLL keeps the GIL


def test_waits_longer_than_the_limit_where_it_says_so():
    import time

    from helpers import hang_limit

    hang_limit.allow(3)
    time.sleep(2)  # past the limit the test runs under (1 s)
