"""The card's SM clock, power draw, temperature and clock-lowering reasons while a benchmark
times a call, read through NVML (`nvidia-ml-py`, in the GPU image), so that a paired
speed-up can be read next to the clocks each side ran at.

Why: the 30B up-proj's time moved 3340-3551 us across sessions 50-52 and by 16% between
the rounds of one run (session 52), while the Qwen3-width kernel on the same machine stayed
within 1%. A heavy kernel that draws the card to its power limit runs at a lower SM clock,
and round-robin pairing (`forward.interleaved_times_ms`) spreads that drift over all configs
without saying whether it happened. The samples say it.

`ClockLog.sampling(key)` samples every `period_s` in a background thread while its block
runs; `summary(key)` / `describe(key)` report what the samples under `key` saw. Where NVML
cannot be loaded (no GPU, as on CI) the log is empty and says so; timing goes on unchanged.
"""

from __future__ import annotations

import contextlib
import statistics
import threading

# NVML's clock-event ("throttle") reason bits that lower the SM clock below what the card
# would otherwise run (`nvmlClocksEventReason*`; the idle and application-clock bits are
# not counted: they are not a slowdown of a running kernel).
SLOWDOWN_REASONS = {
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
}
NVML_CLOCK_SM = 1  # nvmlClockType_t
NVML_TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t


class ClockLog:
    """Samples `(SM MHz, watts, degrees C, reason bits)` of one card per key.

    Args:
      period_s: seconds between samples (an NVML read takes tens of microseconds).
      device_index: the NVML index of the card (0: the one GPU of a one-GPU machine).
      nvml: the NVML module to read through (default: `pynvml`, initialized here; tests pass
        a stand-in). None if it cannot be loaded: then nothing is sampled.
    """

    def __init__(self, period_s: float = 0.002, device_index: int = 0, nvml=None):
        if period_s <= 0:
            raise ValueError(f"period_s={period_s} must be > 0.")
        self.period_s = period_s
        self._nvml = nvml if nvml is not None else _load_nvml()
        self._handle = None
        self.unavailable_reason = None
        if self._nvml is None:
            self.unavailable_reason = "NVML could not be loaded (no GPU or no nvidia-ml-py)"
        else:
            try:
                self._handle = self._nvml.nvmlDeviceGetHandleByIndex(device_index)
            except Exception as e:  # noqa: BLE001 - a card NVML cannot name is reported
                self.unavailable_reason = f"NVML has no device {device_index}: {e}"
            # nvidia-ml-py renamed the reasons query; older releases have only the old name.
            self._reasons = getattr(self._nvml, "nvmlDeviceGetCurrentClocksEventReasons",
                                    None) or self._nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self._samples: dict = {}

    @property
    def available(self) -> bool:
        return self._handle is not None

    def read(self) -> tuple[float, float, float, int]:
        """One sample now: (SM clock MHz, power W, GPU temperature C, clock-event bits)."""
        nv, h = self._nvml, self._handle
        return (float(nv.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)),
                nv.nvmlDeviceGetPowerUsage(h) / 1000.0,  # milliwatts
                float(nv.nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)),
                int(self._reasons(h)))

    @contextlib.contextmanager
    def sampling(self, key):
        """Samples under `key` (appending to earlier samples of it) while the block runs:
        one sample when it starts, then every `period_s` until it ends. A failing read stops
        the sampling of this block (recorded, `summary(key)["errors"]`) but never the block."""
        if not self.available:
            yield
            return
        samples = self._samples.setdefault(key, {"samples": [], "errors": []})
        stop = threading.Event()

        def run():
            while True:
                try:
                    samples["samples"].append(self.read())
                except Exception as e:  # noqa: BLE001 - the timing must go on
                    samples["errors"].append(f"{type(e).__name__}: {e}")
                    return
                if stop.wait(self.period_s):
                    return

        thread = threading.Thread(target=run, name=f"clock-log-{key}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def summary(self, key) -> dict | None:
        """What the samples under `key` saw, or None if there are none: `sm_mhz` (median),
        `sm_mhz_min`, `power_w` (median), `power_w_max`, `temp_c_max`, `samples`, and
        `slowdown`: {reason: share of the samples it was set in} for `SLOWDOWN_REASONS`."""
        got = self._samples.get(key)
        if not got or not got["samples"]:
            return None
        sm, power, temp, bits = zip(*got["samples"])
        n = len(bits)
        slowdown = {name: sum(1 for b in bits if b & bit) / n
                    for bit, name in SLOWDOWN_REASONS.items() if any(b & bit for b in bits)}
        return dict(sm_mhz=statistics.median(sm), sm_mhz_min=min(sm),
                    power_w=statistics.median(power), power_w_max=max(power),
                    temp_c_max=max(temp), samples=n, slowdown=slowdown,
                    errors=list(got["errors"]))

    def describe(self, key) -> str:
        """`summary(key)` as a short log suffix ("" when there is nothing to say)."""
        s = self.summary(key)
        if s is None:
            return ""
        slow = ", ".join(f"{name} {share:.0%}" for name, share in s["slowdown"].items())
        return (f"; SM {s['sm_mhz']:.0f} MHz (min {s['sm_mhz_min']:.0f}), "
                f"{s['power_w']:.0f} W (max {s['power_w_max']:.0f}), {s['temp_c_max']:.0f} C"
                + (f", slowed by {slow}" if slow else ""))


def _load_nvml():
    """`pynvml`, initialized, or None where it cannot be (no module, no driver, no GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - any failure means: no clocks to report
        return None
