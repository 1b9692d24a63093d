"""moebench: benchmark and autotuning harness for Mixture-of-Experts GPU kernels."""

from moebench.kernels.modular import ActivationFormat, FusedMoEKernel
from moebench.kernels.reference import reference_moe
from moebench.backends import check_combination, make_kernel
from moebench.layout import ParallelLayout
from moebench.quant import QuantScheme, QuantWeight, quantize_weights

__version__ = "0.1.0"
__all__ = [
    "ActivationFormat", "FusedMoEKernel", "ParallelLayout", "QuantScheme", "QuantWeight", "check_combination",
    "make_kernel", "quantize_weights", "reference_moe",
]
