"""The GPUs the planner knows, their datasheet figures, and the efficiencies it assumes of them.

Every constant the cost model uses is in this module, in two tables, so a reader can see (and a
calibration file can replace) each one:

* `GPUS`: peak figures per GPU from the vendor's datasheet, dense (no 2:4 sparsity), in SI units.
  NVLink and NIC bandwidths are per GPU and per direction (the datasheets quote NVLink both ways
  added: 900 GB/s on H100 is 450 GB/s each way). H800 is here because DeepEP's published runs are
  on it: an H100 with NVLink cut to 400 GB/s both ways.
* `ASSUMED`: what fraction of a peak a real kernel reaches, and the fixed latencies. These are
  judgement, not measurement: the docstring of `Efficiency` says where each comes from, and
  `--calibrate` replaces them with measured figures (`calibrate.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class GPU:
    """One GPU's peak figures (bytes/s, flop/s, bytes) and the NVLink domain it sits in."""

    name: str
    hbm_bw: float
    hbm_bytes: float
    bf16_flops: float
    fp8_flops: float
    fp32_flops: float
    """CUDA cores' float32 rate (no tensor cores): the DeltaNet's recurrent update runs on them."""
    nvlink_bw: float
    """Per direction, per GPU."""
    nic_bw: float
    """Per direction, per GPU: one NIC per GPU, as in every system below."""
    sms: int
    nvlink_domain: int
    """GPUs one NVLink domain joins (a node of 8, or a 72-GPU rack)."""
    source: str


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU(
            "h100",
            3.35e3 * GB,
            80 * GB,
            989 * TFLOPS,
            1979 * TFLOPS,
            67 * TFLOPS,
            450 * GB,
            50 * GB,
            132,
            8,
            "NVIDIA H100 SXM datasheet (HBM3 3.35 TB/s, BF16 989 / FP8 1979 TFLOPS dense, FP32 67 TFLOPS, "
            "NVLink 900 GB/s); ConnectX-7 400 Gb/s per GPU",
        ),
        GPU(
            "h800",
            3.35e3 * GB,
            80 * GB,
            989 * TFLOPS,
            1979 * TFLOPS,
            67 * TFLOPS,
            200 * GB,
            50 * GB,
            132,
            8,
            "H100 figures with NVLink 400 GB/s (NVIDIA H800 SXM datasheet); DeepEP README: "
            "~160 GB/s NVLink reached, CX7 400 Gb/s (~50 GB/s)",
        ),
        GPU(
            "h200",
            4.8e3 * GB,
            141 * GB,
            989 * TFLOPS,
            1979 * TFLOPS,
            67 * TFLOPS,
            450 * GB,
            50 * GB,
            132,
            8,
            "NVIDIA H200 SXM datasheet (HBM3e 4.8 TB/s, 141 GB; compute as H100); ConnectX-7 400 Gb/s",
        ),
        GPU(
            "b200",
            8e3 * GB,
            180 * GB,
            2250 * TFLOPS,
            4500 * TFLOPS,
            80 * TFLOPS,
            900 * GB,
            50 * GB,
            148,
            8,
            "NVIDIA DGX/HGX B200 datasheet (8 TB/s, 180 GB, BF16 2.25 / FP8 4.5 PFLOPS dense, NVLink5 "
            "1.8 TB/s); FP32 80 TFLOPS (NVIDIA Blackwell technical brief, HGX B200); ConnectX-7 400 Gb/s",
        ),
        GPU(
            "gb200",
            8e3 * GB,
            186 * GB,
            2500 * TFLOPS,
            5000 * TFLOPS,
            90 * TFLOPS,
            900 * GB,
            50 * GB,
            148,
            72,
            "NVIDIA GB200 NVL72 datasheet (per GPU: 8 TB/s, 186 GB, BF16 2.5 / FP8 5 PFLOPS dense, NVLink5 "
            "1.8 TB/s, 72-GPU domain); FP32 90 TFLOPS (NVIDIA Blackwell technical brief, GB200); "
            "400 Gb/s NIC per GPU (assumed)",
        ),
    )
}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak and fixed costs (seconds) the model assumes where nothing is measured.

    gemm 0.7: DeepGEMM reports ~1550 FP8 TFLOPS on H800 for large grouped GEMMs (0.78 of peak),
    smaller shapes less. attention 0.6: FlashMLA reports ~660 BF16 TFLOPS on H800 (0.67); the
    DeltaNet's chunked prefill (tf32 tensor-core products, `Hardware.tf32_flops`) is assumed the
    same. vector 0.5: float32 work on the CUDA cores (the DeltaNet's recurrent update, its
    chunks' triangular solve), short dependent loops over registers: assumed.
    hbm 0.8: a streaming kernel's usual share of HBM bandwidth. nvlink 0.8, nic 0.8: DeepEP's
    normal kernels reach ~153 of H800's ~200 GB/s NVLink and 43-58 of CX7's 50 GB/s RDMA.
    a2a_latency_s: the fixed part of one dispatch or combine (launch, signalling, the receiver's
    wait), and allreduce_latency_s of one NVLink all-reduce: both assumed. step_overhead_s: host
    time per step not hidden by CUDA graphs (scheduling, sampling, output): assumed."""

    gemm: float = 0.7
    attention: float = 0.6
    vector: float = 0.5
    hbm: float = 0.8
    nvlink: float = 0.8
    nic: float = 0.8
    a2a_latency_s: float = 15e-6
    allreduce_latency_s: float = 10e-6
    step_overhead_s: float = 1e-3


ASSUMED = Efficiency()
TF32_PER_BF16 = 0.5


@dataclass(frozen=True)
class Hardware:
    """The effective figures the cost terms divide by: peak times efficiency, or measured.

    `measured` names the fields a calibration file replaced; every other figure is assumed."""

    gpu: GPU
    hbm_bw: float
    bf16_flops: float
    fp8_flops: float
    attention_flops: float
    fp32_flops: float
    nvlink_bw: float
    nic_bw: float
    a2a_latency_s: float
    allreduce_latency_s: float
    step_overhead_s: float
    measured: tuple[str, ...] = ()

    @classmethod
    def of(cls, gpu: GPU | str, eff: Efficiency = ASSUMED) -> Hardware:
        g = gpu if isinstance(gpu, GPU) else gpu_named(gpu)
        return cls(
            g,
            g.hbm_bw * eff.hbm,
            g.bf16_flops * eff.gemm,
            g.fp8_flops * eff.gemm,
            g.bf16_flops * eff.attention,
            g.fp32_flops * eff.vector,
            g.nvlink_bw * eff.nvlink,
            g.nic_bw * eff.nic,
            eff.a2a_latency_s,
            eff.allreduce_latency_s,
            eff.step_overhead_s,
        )

    @property
    def tf32_flops(self) -> float:
        """Tensor cores on float32 operands (tf32), at attention's efficiency: half the bf16 rate
        on every GPU here (H100 494 against 989 TFLOPS dense; B200 1.1 against 2.25 PFLOPS;
        GB200 1.25 against 2.5), so derived rather than another figure to measure."""
        return self.attention_flops * TF32_PER_BF16

    def with_measured(self, **figures: float) -> Hardware:
        """These figures replaced by measured ones, and named as measured."""
        names = tuple(sorted(set(self.measured) | set(figures)))
        return dataclasses.replace(self, **figures, measured=names)

    def provenance(self) -> dict[str, str]:
        """Each figure the model uses: "measured" or "assumed"."""
        skip = {"gpu", "measured"}
        return {
            f.name: ("measured" if f.name in self.measured else "assumed")
            for f in dataclasses.fields(self)
            if f.name not in skip
        }


def gpu_named(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None
