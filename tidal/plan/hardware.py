"""Accelerators the planner knows: peak bf16 FLOP/s, HBM size and bandwidth, and link bandwidths, from
their vendors' public specifications (docs/plan.md cites each). The choice: a table of peaks, and the
efficiency of each kind of work (decode, prefill, training, links) as stated parameters of the cost
model (`spec.Efficiency`), so that one calibration of the efficiencies and one table of peaks fit every
accelerator, this CPU included (`tidal plan calibrate` writes a `cpu` entry with eff = 1 and the peak
set to what was measured).

Bandwidths are per direction, per GPU, in bytes/s: NVLink figures are the vendor's bidirectional
total halved; the network is one NIC per GPU (DGX/HGX systems), in bits/s over 8.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

G, T = 1e9, 1e12


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_flops: float  # dense (no structured sparsity) peak FLOP/s
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    nvlink_bw: float  # bytes/s per GPU per direction within a node
    nic_bw: float  # bytes/s per GPU per direction across nodes (InfiniBand)
    pcie_bw: float  # bytes/s host <-> device per direction (offload, sleep/wake)
    link_latency_s: float = 5e-6  # one collective hop (NCCL over NVLink ~ a few µs)
    note: str = ""


ACCELERATORS: dict[str, Accelerator] = {
    "A100": Accelerator("A100", 312 * T, 80 * G, 2.039 * T, 300 * G, 25 * G, 32 * G,
                        note="A100 SXM4 80GB: 312 TFLOPS bf16, 2,039 GB/s HBM2e, NVLink3 600 GB/s, HDR 200 Gb/s"),
    "H100": Accelerator("H100", 989 * T, 80 * G, 3.35 * T, 450 * G, 50 * G, 64 * G,
                        note="H100 SXM5: 989 TFLOPS bf16, 3.35 TB/s HBM3, NVLink4 900 GB/s, NDR 400 Gb/s"),
    "H800": Accelerator("H800", 989 * T, 80 * G, 3.35 * T, 200 * G, 50 * G, 64 * G,
                        note="H800 SXM5: the H100 with NVLink 400 GB/s"),
    "H20": Accelerator("H20", 148 * T, 96 * G, 4.0 * T, 450 * G, 50 * G, 64 * G,
                       note="H20: 148 TFLOPS bf16, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s"),
    "H200": Accelerator("H200", 989 * T, 141 * G, 4.8 * T, 450 * G, 50 * G, 64 * G,
                        note="H200 SXM: 989 TFLOPS bf16, 141 GB HBM3e at 4.8 TB/s, NVLink4 900 GB/s, NDR 400 Gb/s"),
    "B200": Accelerator("B200", 2250 * T, 180 * G, 8.0 * T, 900 * G, 50 * G, 64 * G,
                        note="B200 (HGX B200): 2.25 PFLOPS dense bf16, 180 GB HBM3e at 8 TB/s, NVLink5 1.8 TB/s, "
                             "ConnectX-7 400 Gb/s"),
}

# Networks other than one InfiniBand NIC per GPU (cluster.network): bytes/s per GPU per direction.
NETWORKS = {"ib": None, "roce": None, "ethernet_100g": 100e9 / 8 / 8, "ethernet_400g": 400e9 / 8 / 8}


def accelerator(name: str, overrides: dict[str, float] | None = None) -> Accelerator:
    """The named accelerator, with any field replaced by `overrides` (a calibrated CPU, a cluster whose
    NICs differ); a name not in the table is an error that lists the known ones."""
    if name not in ACCELERATORS:
        raise ValueError(f"cluster.gpu: unknown accelerator `{name}` (known: {', '.join(sorted(ACCELERATORS))}; "
                         f"or give a calibrated one with cluster.accelerator)")
    return replace(ACCELERATORS[name], **(overrides or {}))
