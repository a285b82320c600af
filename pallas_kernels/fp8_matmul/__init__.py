"""FP8 weight-only matmul (e4m3 values, float32 block or per-channel scales) as a Pallas (Triton)
kernel for decode-sized batches."""
from pallas_kernels.fp8_matmul.kernel import MAX_ROWS, fp8_weight_matmul, kernel_takes

__all__ = ["MAX_ROWS", "fp8_weight_matmul", "kernel_takes"]
