"""FP8 matmul (e4m3 weight values, float32 block or per-channel scales) as a Pallas (Triton)
kernel for decode-sized batches: weight-only, or with x quantized to e4m3 per 128-column group
(activations="fp8"); variant="stream" is the weight-only decode GEMV of stream.py."""
from pallas_kernels.fp8_matmul.activations import quantize_activations
from pallas_kernels.fp8_matmul.kernel import (ACTIVATIONS, MAX_ROWS, VARIANTS, fp8_weight_matmul,
                                              kernel_takes)

__all__ = ["ACTIVATIONS", "MAX_ROWS", "VARIANTS", "fp8_weight_matmul", "kernel_takes",
           "quantize_activations"]
