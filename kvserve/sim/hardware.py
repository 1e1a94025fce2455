"""Accelerator specs for the simulator: datasheet peaks, not achieved figures.

Achieved fractions (efficiency factors) live in the cost model and come from calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True)
class HardwareSpec:
    """One device: memory, HBM bandwidth, dense FLOP/s, and its links.

    ``interconnect_bandwidth`` is one direction of the device-to-device link (NVLink) used by
    ring all-reduce under tensor parallelism; ``host_link_bandwidth`` is the host<->device link
    (PCIe) used by swap preemption.
    """

    name: str
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    peak_flops: float  # dense FLOP/s at the model's 16-bit dtype (fp32 for the CPU)
    interconnect_bandwidth: float  # bytes/s per direction; 0 = no device-to-device link
    host_link_bandwidth: float  # bytes/s, host <-> device copies
    allreduce_latency_s: float = 5e-6  # per all-reduce call
    max_tp: int = 8

    def __post_init__(self) -> None:
        for f in ("memory_bytes", "memory_bandwidth", "peak_flops", "host_link_bandwidth"):
            v = getattr(self, f)
            if not v > 0:
                raise ValueError(f"HardwareSpec.{f} must be > 0, got {v!r}")
        if self.interconnect_bandwidth < 0 or self.allreduce_latency_s < 0:
            raise ValueError("HardwareSpec link figures must be >= 0")

    def check_tp(self, tp: int) -> None:
        """Raise ValueError when ``tp`` GPUs of this kind cannot form one tensor-parallel group."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor parallel degree must be a positive int, got {tp!r}")
        if tp > self.max_tp:
            raise ValueError(
                f"{self.name} supports tensor parallel degree <= {self.max_tp}, got {tp}"
            )
        if tp > 1 and self.interconnect_bandwidth <= 0:
            raise ValueError(f"{self.name} has no device-to-device link for tensor parallelism")


# NOTE: datasheet figures (SXM parts). H100/H200 NVLink 4: 900 GB/s bidirectional = 450 GB/s per
# direction; A100 NVLink 3: 600 GB/s bidirectional. PCIe Gen5 x16 ~64 GB/s, Gen4 ~32 GB/s per
# direction (peak; achieved is lower, which the swap figures will understate).
HARDWARE: dict[str, HardwareSpec] = {
    "h100": HardwareSpec(
        name="H100-SXM-80G",
        memory_bytes=80 * GB,
        memory_bandwidth=3.35e12,
        peak_flops=989e12,
        interconnect_bandwidth=450 * GB,
        host_link_bandwidth=64 * GB,
    ),
    "h200": HardwareSpec(
        name="H200-SXM-141G",
        memory_bytes=141 * GB,
        memory_bandwidth=4.8e12,
        peak_flops=989e12,
        interconnect_bandwidth=450 * GB,
        host_link_bandwidth=64 * GB,
    ),
    "a100": HardwareSpec(
        name="A100-SXM-80G",
        memory_bytes=80 * GB,
        memory_bandwidth=2.039e12,
        peak_flops=312e12,
        interconnect_bandwidth=300 * GB,
        host_link_bandwidth=32 * GB,
    ),
    # "This machine": a 2-core CPU. Swap is a host memcpy (read + write) at memory bandwidth.
    "cpu": HardwareSpec(
        name="this-machine-2core-cpu",
        memory_bytes=24 * GiB,
        memory_bandwidth=17 * GB,
        peak_flops=150e9,
        interconnect_bandwidth=0.0,
        host_link_bandwidth=8.5 * GB,
        allreduce_latency_s=0.0,
        max_tp=1,
    ),
}

ALIASES = {
    "h100-sxm": "h100",
    "h100sxm": "h100",
    "a100-80g": "a100",
    "a100-80gb": "a100",
    "this-machine": "cpu",
    "local": "cpu",
}


def get_hardware(name: str) -> HardwareSpec:
    """A hardware preset by name: h100, h200, a100 (a100-80g), cpu (this-machine)."""
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in HARDWARE:
        raise ValueError(
            f"unknown gpu {name!r}; expected one of {', '.join(list(HARDWARE) + list(ALIASES))}"
        )
    return HARDWARE[key]
