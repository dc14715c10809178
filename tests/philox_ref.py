"""The reference of ops.dropout's mask, independent of pydiff: Philox4x32-10 (Salmon et al.,
SC 2011) in Python integers, and which elements dropout keeps (shared by the dropout tests and
the edge grid)."""

import math

import numpy as np

M32 = 0xFFFFFFFF


def philox4x32(counter, key):
    """Philox4x32-10 (Salmon et al. 2011) in Python integers: the reference."""
    c, k = [int(v) for v in counter], [int(key[0]), int(key[1])]
    for r in range(10):
        if r:
            k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
    return c


def keep_mask(n, p, seed):
    """Element i kept where word i % 4 of philox((i // 4, 0, 0, 0), seed) >= floor(p 2^32)."""
    if p >= 1:
        return np.zeros(n, bool)
    key = (seed & M32, seed >> 32)
    words = [w for q in range(-(-n // 4)) for w in philox4x32((q, 0, 0, 0), key)]
    return np.array(words[:n], np.uint64) >= math.floor(p * 2.0**32)
