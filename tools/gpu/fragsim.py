#!/usr/bin/env python3
"""Checks, without a GPU, how three kernels arrange their m16n8k16 operands: the PTX fragment
layouts of mma.sync.m16n8k16.row.col (f16 in, f32 out) simulated lane by lane, fed the way
mla_combine_uv and mla_absorb_h (kernels/fast.cu) and dense_h16c_body (kernels/mmq.cu) feed
them, with small integers, against the plain product (exact). It checks the index arithmetic
the kernels' comments describe: the 32-value steps' k order (lane t's 16 bytes feeding logical k
{2t, 2t+1, 2t+8, 2t+9} of two mma's), the token pairs' interleaved words of dense_h16c_body,
and where each accumulator lands. Not the CUDA code itself: the op tests on a GPU do that.
Usage: python3 tools/gpu/fragsim.py (prints "fragment arrangements: ok").
"""
import random
random.seed(1)
class M:
    def __init__(self, r, c, rand=False):
        self.v = [[(random.randint(-3, 3) if rand else 0) for _ in range(c)] for _ in range(r)]
    def __getitem__(self, i): return self.v[i]
def matmul_T(X, W, n):  # X n x K times W^T (rows x K)
    return [[sum(a*b for a, b in zip(X[i], W[j])) for j in range(len(W.v))] for i in range(n)]

def mma(c, a_regs, b_regs):
    """a_regs[lane] = 4 pairs (each a 2-tuple of values), b_regs[lane] = 2 pairs; c[lane] = 4 floats."""
    A = [[0]*16 for _ in range(16)]; B = [[0]*8 for _ in range(16)]
    for l in range(32):
        g, t = l // 4, l % 4
        a = a_regs[l]; b = b_regs[l]
        A[g][2*t], A[g][2*t+1] = a[0]
        A[g+8][2*t], A[g+8][2*t+1] = a[1]
        A[g][2*t+8], A[g][2*t+9] = a[2]
        A[g+8][2*t+8], A[g+8][2*t+9] = a[3]
        B[2*t][g], B[2*t+1][g] = b[0]
        B[2*t+8][g], B[2*t+9][g] = b[1]
    C = [[sum(A[i][k]*B[k][j] for k in range(16)) for j in range(8)] for i in range(16)]
    for l in range(32):
        g, t = l // 4, l % 4
        c[l][0] += C[g][2*t]; c[l][1] += C[g][2*t+1]; c[l][2] += C[g+8][2*t]; c[l][3] += C[g+8][2*t+1]

def words(row, off):  # 32-bit word at half offset off: (row[off], row[off+1])
    return (row[off], row[off+1])

# ---- dense_h16c_body: one warp, 8 W rows, KC values of K, tokens n<=64 -------------------------
def check_dense(n, KC=64):
    X = M(64, KC, True)
    for r in range(n, 64): X.v[r] = [0]*KC
    W = M(8, KC, True)
    # pair-interleaved smem: pair p row: word w of token 2p at 2w, of token 2p+1 at 2w+1
    PSW = KC // 2 * 2  # words per pair row (we index in words)
    xs = [[None] * (KC) for _ in range(32)]  # pair rows of KC words (each word a 2-tuple)
    for p in range(32):
        for w in range(KC // 2):
            xs[p][2*w] = words(X[2*p], 2*w)
            xs[p][2*w+1] = words(X[2*p+1], 2*w)
    mt = (n + 15) // 16
    acc = [[[0]*4 for _ in range(32)] for _ in range(4)]
    for kc in range(KC // 32):
        # wv[kc] per lane: W row g, halves 32kc + 8t .. +7 -> 4 words
        wv = []
        for l in range(32):
            g, t = l // 4, l % 4
            base = 32*kc + 8*t
            wv.append([words(W[g], base + 2*j) for j in range(4)])
        for i in range(4):
            if i >= mt: continue
            a_regs0, a_regs1, b0, b1 = [], [], [], []
            for l in range(32):
                g, t = l // 4, l % 4
                prow = xs[8*i + g]
                off = 32*kc + 8*t  # in words of the pair row
                a = prow[off:off+4]; b = prow[off+4:off+8]
                a_regs0.append(a); a_regs1.append(b)
                b0.append((wv[l][0], wv[l][1])); b1.append((wv[l][2], wv[l][3]))
            mma(acc[i], a_regs0, b0)
            mma(acc[i], a_regs1, b1)
    # gather: acc[i][lane][0..1] -> token 16i+2g, rows 2t, 2t+1 ; [2..3] -> token 16i+2g+1
    C = [[0]*8 for _ in range(64)]
    for i in range(mt):
        for l in range(32):
            g, t = l // 4, l % 4
            C[16*i + 2*g][2*t] = acc[i][l][0]; C[16*i + 2*g][2*t+1] = acc[i][l][1]
            C[16*i + 2*g + 1][2*t] = acc[i][l][2]; C[16*i + 2*g + 1][2*t+1] = acc[i][l][3]
    ref = matmul_T(X, W, n)
    assert C[:n] == ref, n

# ---- mla_combine_uv (8 tokens in rows g, rows g+8 zero) and mla_absorb_h (16 tokens: token g
# in rows g, token g+8 in rows g+8); W rows c0+g; xs rows of halves ------------------------------
def check_halves(T, K):
    X = M(T, K, True); W = M(8, K, True)
    acc = [[0]*4 for _ in range(32)]
    z = [(0, 0)] * 4
    for kc in range(K // 32):
        a0s, a1s, b0s, b1s = [], [], [], []
        for l in range(32):
            g, t = l // 4, l % 4
            base = 32*kc + 8*t
            xa = [words(X[g], base + 2*j) for j in range(4)]
            xb = [words(X[g+8], base + 2*j) for j in range(4)] if T == 16 else z
            w = [words(W[g], base + 2*j) for j in range(4)]
            a0s.append([xa[0], xb[0], xa[1], xb[1]]); a1s.append([xa[2], xb[2], xa[3], xb[3]])
            b0s.append((w[0], w[1])); b1s.append((w[2], w[3]))
        mma(acc, a0s, b0s); mma(acc, a1s, b1s)
    C = [[0]*8 for _ in range(16)]
    for l in range(32):
        g, t = l // 4, l % 4
        C[g][2*t], C[g][2*t+1], C[g+8][2*t], C[g+8][2*t+1] = acc[l]
    assert C[:T] == matmul_T(X, W, T), T
    assert all(v == 0 for row in C[T:] for v in row)

for n in [9, 16, 17, 33, 64]:
    check_dense(n)
check_halves(8, 64); check_halves(16, 128)
print("fragment arrangements: ok")
