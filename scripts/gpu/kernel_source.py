#!/usr/bin/env python3
"""The CUDA body of one of mlxgate's kernels, as MLX's `fast::cuda_kernel`
takes it: the text between `R"NAME(` and `)NAME"` in a file of
mlx-sys/kernels/. The probes import `body`; check_kernels.sh runs it:

    kernel_source.py FILE NAME     (FILE relative to mlx-sys/kernels/)
"""
import os
import sys

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../mlx-sys/kernels")


def body(file, name):
    text = open(os.path.join(KERNELS, file)).read()
    return text[text.index(f'R"{name}(') + len(f'R"{name}('):text.index(f'){name}"')]


if __name__ == "__main__":
    sys.stdout.write(body(sys.argv[1], sys.argv[2]))
