"""The reference PowerSGD algorithm (numpy, no library code) in the regime where it is exact -- 2 ranks,
rank-1 gradients, r = 2, error feedback on, warm start off -- printing every 3rd step how far the averaged
output is from the true mean. Shows that rounding grows geometrically under error feedback in float32 and
float64 alike (docs/torch.md, "Parity"):

    /usr/bin/python3 bench/powersgd_ef_rounding.py 32
    /usr/bin/python3 bench/powersgd_ef_rounding.py 64
"""
import sys

import numpy as np


def main():
    dtype = {"32": np.float32, "64": np.float64}[sys.argv[1] if len(sys.argv) > 1 else "32"]
    rng = np.random.default_rng(0)
    ranks, n, m, r = 2, 32, 16, 2
    errors = [np.zeros((n, m), dtype) for _ in range(ranks)]
    print("step  max|output - mean|  max|error memory|")
    for step in range(30):
        grads = [np.outer(rng.standard_normal(n), rng.standard_normal(m)).astype(dtype) for _ in range(ranks)]
        mean = sum(grads) / ranks
        ms = [g + e for g, e in zip(grads, errors)]
        q = rng.standard_normal((m, r)).astype(dtype)
        p = sum(mm @ q for mm in ms)  # allreduce (sum) of P
        for j in range(r):            # Gram-Schmidt, epsilon 0
            for k in range(j):
                p[:, j] -= p[:, k] * (p[:, k] @ p[:, j])
            p[:, j] /= np.linalg.norm(p[:, j])
        q = sum(mm.T @ p for mm in ms) / ranks  # allreduce of Q, averaged
        output = p @ q.T
        errors = [mm - output for mm in ms]
        if step % 3 == 2:
            print("%4d  %18.3g  %17.3g" % (step, np.abs(output - mean).max(), np.abs(errors[0]).max()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
