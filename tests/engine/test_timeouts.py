"""Every public wait takes a timeout in seconds, checked the same way (chatkv.errors.check_timeout).

Found by trying bad values: nan timed out at once in ``EngineLoop.call`` and waited in
``RequestStream.wait``; infinity and 1e300 raised OverflowError from inside ``threading``;
``"5"`` raised TypeError about ``+``. Now nan, negatives, bools and non-numbers are InvalidRequest
naming the value, before anything waits or closes; infinity (or more than the platform can wait)
means no limit, as None does.
"""

from __future__ import annotations

import threading

import pytest

from chatkv import Engine, InvalidRequest
from chatkv.config import EngineConfig
from chatkv.engine.sampling import SamplingParams
from chatkv.errors import check_timeout

pytestmark = pytest.mark.tiny_model("llama", seed=3)

BAD = [float("nan"), -1.0, -1, "5", True, [1], complex(1, 0)]


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_bad_timeouts_are_refused_by_name(value):
    with pytest.raises(InvalidRequest, match=r"timeout must be a number of seconds"):
        check_timeout(value)


@pytest.mark.parametrize(
    "value,seconds",
    [
        (None, None),
        (0, 0.0),
        (2.5, 2.5),
        (float("inf"), None),
        (1e300, None),
        (10**400, None),
        (threading.TIMEOUT_MAX, threading.TIMEOUT_MAX),
    ],
)
def test_good_timeouts(value, seconds):
    assert check_timeout(value) == seconds


def test_the_engines_waits_check_their_timeouts(model_dir, tmp_path):
    e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path)))
    e.start()
    try:
        stream = e.submit([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
        for bad in (float("nan"), -1, "5"):
            with pytest.raises(InvalidRequest, match="timeout"):
                stream.wait(bad)
            with pytest.raises(InvalidRequest, match="timeout"):
                e._loop.call(lambda: 1, timeout=bad)
            with pytest.raises(InvalidRequest, match="timeout"):
                e.close(bad)
        assert stream.wait(float("inf")) is True  # no limit: waits until it is done
        assert e._loop.call(lambda: 7, timeout=1e300) == 7
        assert len(stream.result().token_ids) == 4  # the refused close() closed nothing
    finally:
        done = threading.Thread(target=e.close, args=(float("inf"),), daemon=True)
        done.start()
        done.join(60)
        assert not done.is_alive()
    with pytest.raises(Exception, match="closed"):
        e.submit([1, 2, 3], SamplingParams(max_tokens=1))
