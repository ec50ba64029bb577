"""While compiles run (overlapping, in several threads) the interpreter switches often; the last one out puts the
interval from before back."""

import sys
import threading

import pytest

from devmap.serving.interpreter_switch import SHARED, switching_often


def test_the_switch_interval_is_short_while_any_compile_runs_and_comes_back_after_the_last():
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        entered, release = threading.Event(), threading.Event()

        def other_compile():
            with switching_often():
                entered.set()
                assert release.wait(10)

        thread = threading.Thread(target=other_compile)
        with switching_often():
            assert sys.getswitchinterval() == pytest.approx(SHARED, abs=1e-6)
            thread.start()
            assert entered.wait(10)
        assert sys.getswitchinterval() == pytest.approx(SHARED, abs=1e-6)  # the other thread's compile still runs
        release.set()
        thread.join()
        assert sys.getswitchinterval() == pytest.approx(0.004, abs=1e-6)
        sys.setswitchinterval(20e-6)  # already shorter: left as it is
        with switching_often():
            assert sys.getswitchinterval() == pytest.approx(20e-6, abs=1e-6)
        assert sys.getswitchinterval() == pytest.approx(20e-6, abs=1e-6)
    finally:
        sys.setswitchinterval(before)
