"""CPU of one wake-up of an event loop that does nothing else: the floor under every
frame a tier reads between engine steps.

Usage: ``.venv/bin/python scripts/wake_cost.py [--periods 0.002,0.01,0.1,0.15] [--seconds 10]``

A uvloop loop (as the tiers run) sleeps ``period`` seconds again and again; the process's
own CPU over the run (rusage), divided by the wake-ups, is what the kernel and the
interpreter charge a process for waking with nothing to do. The longer the sleep, the
colder the caches it wakes to. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _measure(period: float, seconds: float) -> tuple[int, float]:
    cpu, started, wakes = _cpu_s(), time.monotonic(), 0
    while time.monotonic() - started < seconds:
        await asyncio.sleep(period)
        wakes += 1
    return wakes, _cpu_s() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--periods", default="0.002,0.01,0.1,0.15", help="sleeps between wake-ups, seconds")
    parser.add_argument("--seconds", type=float, default=10.0, help="run per period")
    args = parser.parse_args()
    import uvloop

    for period in (float(p) for p in args.periods.split(",")):
        wakes, cpu = uvloop.run(_measure(period, args.seconds))
        print(f"period {period * 1000:7.1f} ms: {wakes:6d} wake-ups, {cpu * 1e6 / wakes:6.0f} us CPU each")


if __name__ == "__main__":
    main()
