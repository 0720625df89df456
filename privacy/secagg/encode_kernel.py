"""The quantizer's inner loop, compiled by numba: clip, scale, shift, round and store in one
pass over the update, with the non-finite check and (on request) the count of clipped
coordinates folded in.

numpy needs four float64 passes per chunk plus a min/max pass for the same work; this loop
reads each coordinate once, keeps the arithmetic in registers and writes the word. The
float64 operations and their order are those of the reference
(:func:`privacy.secagg.quantize.quantize_weighted`): y = a * clip(x) + b, then
round-half-even (``rint``) or floor(y + U), then clamp to [0, level]. Compiled code is
cached on disk next to this module, so a process pays the compilation (about half a
second per argument type) once per machine.
"""

from __future__ import annotations

import numba
import numpy as np

_TOP32 = np.uint32(1 << 31)
_TOP64 = np.uint64(1 << 63)
_2_31 = 2.0**31
_2_63 = 2.0**63
_2_NEG_32 = 2.0**-32


@numba.njit(cache=True, nogil=True, boundscheck=False)
def encode(x, noise, out, a, b, clip, level, count=False):  # types: numba infers them per call
    """out[i] = R(a * clip(x[i], -clip, clip) + b) clamped to [0, level]; returns -1 if x
    holds a NaN or an infinity (``out`` is then garbage), else with ``count`` how many x[i]
    lie outside [-clip, clip] (compared in float64), without it 0.

    R rounds half to even when ``noise`` is empty, else R(y) = floor(y + noise[i] / 2^32)
    (``noise``: uint32 words, one per coordinate). ``out`` has unsigned words that hold
    ``level`` (a float). Words of up to 32 bits are stored through int32 (vectorizable on
    x86: there is no packed float-to-uint32 conversion before AVX-512), 64-bit words
    through int64, with the top bit handled apart.
    """
    wide = out.itemsize == 8
    stochastic = noise.size > 0
    bad = False
    clipped = 0
    for i in range(x.size):
        xi = np.float64(x[i])
        bad |= (xi - xi) != 0.0  # NaN for NaN and +-inf
        if count:
            clipped += (xi > clip) | (xi < -clip)
        y = min(max(xi, -clip), clip) * a + b
        q = np.floor(y + np.float64(noise[i]) * _2_NEG_32) if stochastic else np.rint(y)
        q = min(max(q, 0.0), level)
        if not wide:
            out[i] = np.uint32(np.int32(q - _2_31)) ^ _TOP32
        elif q < _2_63:
            out[i] = np.uint64(np.int64(q))
        else:
            out[i] = np.uint64(np.int64(q - _2_63)) | _TOP64
    return -1 if bad else clipped
