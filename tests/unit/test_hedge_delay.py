"""The hedge delay follows the recent handshakes' 95th percentile, within its floor and cap."""

from __future__ import annotations

from gateway.hedging import HedgeDelay


def test_the_cap_until_enough_handshakes_are_seen() -> None:
    delay = HedgeDelay(cap_s=0.2, warmup=20)
    for _ in range(19):
        delay.observe(0.003)
    assert delay() == 0.2
    delay.observe(0.003)
    assert delay() == 0.01  # the floor: quicker handshakes do not hedge sooner than 10 ms


def test_the_95th_percentile_of_the_window() -> None:
    delay = HedgeDelay(cap_s=1.0, floor_s=0.001, window=100)
    for i in range(100):
        delay.observe((i + 1) / 1000)  # 1..100 ms
    assert delay() == 0.096
    for _ in range(100):  # the slow past leaves the window
        delay.observe(0.002)
    assert delay() == 0.002


def test_never_above_the_cap() -> None:
    delay = HedgeDelay(cap_s=0.2)
    for _ in range(50):
        delay.observe(3.0)
    assert delay() == 0.2
