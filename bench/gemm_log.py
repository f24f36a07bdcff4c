#!/usr/bin/env python3
"""Which cuBLASLt kernel do torch._scaled_mm and qkvfuse's fp8_gemm pick for the same GEMM?

Runs each (impl, shape) once in its own subprocess with CUBLASLT_LOG_LEVEL=2 (trace: kernel
launching calls with their parameters) and prints the log lines that mention cublasLtMatmul or
algo. Needs a GPU, torch and the qkvfuse extension (`import qkvfuse`).

    python bench/gemm_log.py [--tokens T]

qkvfuse runs with QKVFUSE_FP8_GEMM_AUTOTUNE=2, so its autotuner's timings and pick are printed.
"""
import os
import subprocess
import sys
import tempfile

# name: (M, N, K, fast_accum) with M = 0 meaning tokens; d[M, N] = a[M, K] @ b[N, K]^T
SHAPES = {"wgrad_d96": (1920, 768, 49152, False), "wgrad_d128": (2304, 768, 49152, False)}
IMPLS = ("torch._scaled_mm", "qkvfuse.fp8_gemm")


def child(impl, m, n, k, fast_accum):
    import torch
    import qkvfuse  # noqa: F401  (registers torch.ops.qkvfuse)

    def e4m3(rows, cols):
        return (torch.randn(rows, cols, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)

    a, b = e4m3(m, k), e4m3(n, k)
    s = torch.tensor(0.01, device="cuda")
    if impl == "torch._scaled_mm":
        d = torch._scaled_mm(a, b.T, scale_a=s, scale_b=s, out_dtype=torch.bfloat16,
                             use_fast_accum=fast_accum)
    else:
        for _ in range(3):
            d = torch.ops.qkvfuse.fp8_gemm(a, b, s, s, None, fast_accum)
    torch.cuda.synchronize()
    assert d.shape == (m, n) and d.dtype == torch.bfloat16


def main():
    if len(sys.argv) == 7 and sys.argv[1] == "--child":
        _, _, impl, m, n, k, fa = sys.argv
        child(impl, int(m), int(n), int(k), fa == "1")
        return
    tokens = int(sys.argv[2]) if len(sys.argv) == 3 and sys.argv[1] == "--tokens" else 49152
    for name, (m, n, k, fast_accum) in SHAPES.items():
        m = m or tokens
        for impl in IMPLS:
            with tempfile.NamedTemporaryFile(suffix=".log", delete=False) as f:
                log = f.name
            env = dict(os.environ, CUBLASLT_LOG_LEVEL="2", CUBLASLT_LOG_FILE=log,
                       QKVFUSE_FP8_GEMM_AUTOTUNE="2")
            proc = subprocess.run([sys.executable, __file__, "--child", impl, str(m), str(n),
                                   str(k), "1" if fast_accum else "0"],
                                  env=env, capture_output=True, text=True)
            print(f"=== {name} M={m} N={n} K={k} fast_accum={int(fast_accum)}: {impl} "
                  f"(rc={proc.returncode}, log {log})")
            if proc.returncode != 0:
                print(proc.stderr[-2000:])
            print((proc.stdout + proc.stderr)[-3000:])
            lines = []
            if os.path.exists(log):
                with open(log, errors="replace") as f:
                    lines = [line.rstrip() for line in f
                             if "cublasLtMatmul" in line or "algo" in line.lower()]
            print("\n".join(lines) if lines else "(no cublasLtMatmul/algo lines in the log)")
            print()


if __name__ == "__main__":
    main()
