//! f32 vector helpers for the element-wise ops (norms, GLU, softmax, attention).
//!
//! ## Why hand-written SIMD
//! Once the matmuls are fast, these run on the caller's thread between parallel regions, and a
//! decode step calls them ~10 times per layer. The compiler does not vectorise them as written
//! in the reference style: float reductions (dot products, sums of squares, maxima) need
//! reassociation it may not do on its own, and `exp` (SiLU, softmax) is a libm call per
//! element. On x86-64 with AVX2+FMA (detected once, [`crate::quant_dot::simd_available`]) they
//! use 8-lane intrinsics, with `exp` from ggml's `ggml_v_expf` (max error ≈ 2 ulp, the same
//! approximation llama.cpp's CPU backend uses); elsewhere the portable loops below.
//!
//! Results equal the scalar versions up to float rounding (summation order, the `exp`
//! approximation), never more.

use crate::quant_dot::simd_available;

/// Σ a[i]·b[i].
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        // SAFETY: features detected; equal lengths checked.
        return unsafe { avx2::dot(a.as_ptr(), b.as_ptr(), a.len()) };
    }
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// y[i] += a·x[i].
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    assert_eq!(y.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        // SAFETY: features detected; equal lengths checked.
        return unsafe { avx2::axpy(y.as_mut_ptr(), a, x.as_ptr(), y.len()) };
    }
    y.iter_mut().zip(x).for_each(|(v, b)| *v += a * b);
}

/// Σ x[i]².
#[inline]
pub fn sum_sq(x: &[f32]) -> f32 {
    dot(x, x)
}

/// out[i] = x[i]·s·w[i] (w optional). `out` may be `x` (pass the same pointer through
/// [`scale_mul_ptr`] in that case).
///
/// # Safety
/// `x` and `out` point at `n` valid floats (they may be equal); `w`, if non-null, at `n`.
#[inline]
pub unsafe fn scale_mul_ptr(x: *const f32, s: f32, w: *const f32, out: *mut f32, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        return avx2::scale_mul(x, s, w, out, n);
    }
    for i in 0..n {
        let v = *x.add(i) * s;
        *out.add(i) = if w.is_null() { v } else { v * *w.add(i) };
    }
}

/// out[i] = a[i] + b[i]; any of the three may be equal.
///
/// # Safety
/// All point at `n` valid floats.
#[inline]
pub unsafe fn add_ptr(a: *const f32, b: *const f32, out: *mut f32, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        return avx2::add(a, b, out, n);
    }
    for i in 0..n {
        *out.add(i) = *a.add(i) + *b.add(i);
    }
}

/// out[i] = silu(g[i])·u[i] (`gelu == false`) or gelu_tanh(g[i])·u[i]; any may be equal.
///
/// # Safety
/// All point at `n` valid floats.
#[inline]
pub unsafe fn glu_ptr(gelu: bool, g: *const f32, u: *const f32, out: *mut f32, n: usize, scalar: fn(f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        return if gelu { avx2::glu::<true>(g, u, out, n) } else { avx2::glu::<false>(g, u, out, n) };
    }
    for i in 0..n {
        *out.add(i) = scalar(*g.add(i)) * *u.add(i);
    }
}

/// In-place softmax.
#[inline]
pub fn softmax(s: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        // SAFETY: features detected.
        return unsafe { avx2::softmax(s.as_mut_ptr(), s.len()) };
    }
    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in s.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in s.iter_mut() {
        *v *= inv;
    }
}

/// e^x for each lane (exposed for tests).
#[cfg(target_arch = "x86_64")]
pub fn exp8(x: [f32; 8]) -> [f32; 8] {
    assert!(simd_available());
    // SAFETY: features detected.
    unsafe {
        use std::arch::x86_64::*;
        let mut o = [0f32; 8];
        _mm256_storeu_ps(o.as_mut_ptr(), avx2::expf(_mm256_loadu_ps(x.as_ptr())));
        o
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hmax(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_max_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: *const f32, b: *const f32, n: usize) -> f32 {
        let (mut s0, mut s1, mut s2, mut s3) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i + 8)), _mm256_loadu_ps(b.add(i + 8)), s1);
            s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i + 16)), _mm256_loadu_ps(b.add(i + 16)), s2);
            s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i + 24)), _mm256_loadu_ps(b.add(i + 24)), s3);
            i += 32;
        }
        while i + 8 <= n {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), s0);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
        while i < n {
            s += *a.add(i) * *b.add(i);
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(y: *mut f32, a: f32, x: *const f32, n: usize) {
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(y.add(i), _mm256_fmadd_ps(av, _mm256_loadu_ps(x.add(i)), _mm256_loadu_ps(y.add(i))));
            i += 8;
        }
        while i < n {
            *y.add(i) += a * *x.add(i);
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scale_mul(x: *const f32, s: f32, w: *const f32, out: *mut f32, n: usize) {
        let sv = _mm256_set1_ps(s);
        let mut i = 0;
        while i + 8 <= n {
            let v = _mm256_mul_ps(_mm256_loadu_ps(x.add(i)), sv);
            let v = if w.is_null() { v } else { _mm256_mul_ps(v, _mm256_loadu_ps(w.add(i))) };
            _mm256_storeu_ps(out.add(i), v);
            i += 8;
        }
        while i < n {
            let v = *x.add(i) * s;
            *out.add(i) = if w.is_null() { v } else { v * *w.add(i) };
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn add(a: *const f32, b: *const f32, out: *mut f32, n: usize) {
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(out.add(i), _mm256_add_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i))));
            i += 8;
        }
        while i < n {
            *out.add(i) = *a.add(i) + *b.add(i);
            i += 1;
        }
    }

    /// ggml's `ggml_v_expf` (AVX2 + FMA), itself from ARM's optimized-routines: max error
    /// 1.45 + 0.5 ulp; overflow to +inf above ~88.7, underflow to 0 below ~-103.9.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn expf(x: __m256) -> __m256 {
        let r = _mm256_set1_ps(f32::from_bits(0x4b40_0000)); // 0x1.8p23
        let z = _mm256_fmadd_ps(x, _mm256_set1_ps(f32::from_bits(0x3fb8_aa3b)), r); // 1/ln2
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(
            n,
            _mm256_set1_ps(f32::from_bits(0x35bf_be8e)), // ln2 low part 0x1.7f7d1cp-20
            _mm256_fnmadd_ps(n, _mm256_set1_ps(f32::from_bits(0x3f31_7200)), x), // ln2 high part 0x1.62e4p-1
        );
        let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
        let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1.0))));
        let absn = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let c = _mm256_cmp_ps::<_CMP_GT_OQ>(absn, _mm256_set1_ps(126.0));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(_mm256_set1_ps(f32::from_bits(0x3c07_2010)), b, _mm256_set1_ps(f32::from_bits(0x3d2b_9f17))),
                u,
                _mm256_fmadd_ps(_mm256_set1_ps(f32::from_bits(0x3e2a_af33)), b, _mm256_set1_ps(f32::from_bits(0x3eff_fedb))),
            ),
            u,
            _mm256_mul_ps(_mm256_set1_ps(f32::from_bits(0x3f7f_fff6)), b),
        );
        if _mm256_movemask_ps(c) == 0 {
            return _mm256_fmadd_ps(j, k, k);
        }
        let g = _mm256_and_si256(
            _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
            _mm256_set1_epi32(0x8200_0000u32 as i32),
        );
        let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
        let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
        let d = _mm256_cmp_ps::<_CMP_GT_OQ>(absn, _mm256_set1_ps(192.0));
        _mm256_or_ps(
            _mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
            _mm256_andnot_ps(
                d,
                _mm256_or_ps(
                    _mm256_and_ps(c, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                    _mm256_andnot_ps(c, _mm256_fmadd_ps(k, j, k)),
                ),
            ),
        )
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn silu(x: __m256) -> __m256 {
        let one = _mm256_set1_ps(1.0);
        _mm256_div_ps(x, _mm256_add_ps(one, expf(_mm256_sub_ps(_mm256_setzero_ps(), x))))
    }

    /// 0.5·x·(1 + tanh(y)), y = c·(x + 0.044715·x³), computed as x / (1 + e^{−2y}) (the same
    /// function: 1 + tanh(y) = 2 / (1 + e^{−2y})), which has no cancellation where tanh(y) is
    /// near −1 (x below about −3), unlike forming 1 + tanh(y).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn gelu_tanh(x: __m256) -> __m256 {
        let c = _mm256_set1_ps(0.797_884_6);
        let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        let y = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_set1_ps(0.044715), x3, x));
        let e = expf(_mm256_mul_ps(_mm256_set1_ps(-2.0), y));
        _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn glu<const GELU: bool>(g: *const f32, u: *const f32, out: *mut f32, n: usize) {
        let mut i = 0;
        while i < n {
            let m = (n - i).min(8);
            let (gv, uv) = if m == 8 {
                (_mm256_loadu_ps(g.add(i)), _mm256_loadu_ps(u.add(i)))
            } else {
                let (mut gb, mut ub) = ([0f32; 8], [0f32; 8]);
                std::ptr::copy_nonoverlapping(g.add(i), gb.as_mut_ptr(), m);
                std::ptr::copy_nonoverlapping(u.add(i), ub.as_mut_ptr(), m);
                (_mm256_loadu_ps(gb.as_ptr()), _mm256_loadu_ps(ub.as_ptr()))
            };
            let a = if GELU { gelu_tanh(gv) } else { silu(gv) };
            let r = _mm256_mul_ps(a, uv);
            if m == 8 {
                _mm256_storeu_ps(out.add(i), r);
            } else {
                let mut rb = [0f32; 8];
                _mm256_storeu_ps(rb.as_mut_ptr(), r);
                std::ptr::copy_nonoverlapping(rb.as_ptr(), out.add(i), m);
            }
            i += 8;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax(s: *mut f32, n: usize) {
        if n == 0 {
            return;
        }
        let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i + 8 <= n {
            mv = _mm256_max_ps(mv, _mm256_loadu_ps(s.add(i)));
            i += 8;
        }
        let mut max = hmax(mv);
        for t in i..n {
            max = max.max(*s.add(t));
        }
        let maxv = _mm256_set1_ps(max);
        let mut sv = _mm256_setzero_ps();
        i = 0;
        while i + 8 <= n {
            let e = expf(_mm256_sub_ps(_mm256_loadu_ps(s.add(i)), maxv));
            _mm256_storeu_ps(s.add(i), e);
            sv = _mm256_add_ps(sv, e);
            i += 8;
        }
        let mut sum = hsum(sv);
        if i < n {
            let mut b = [f32::NEG_INFINITY; 8];
            std::ptr::copy_nonoverlapping(s.add(i), b.as_mut_ptr(), n - i);
            let e = expf(_mm256_sub_ps(_mm256_loadu_ps(b.as_ptr()), maxv));
            _mm256_storeu_ps(b.as_mut_ptr(), e);
            std::ptr::copy_nonoverlapping(b.as_ptr(), s.add(i), n - i);
            sum += b[..n - i].iter().sum::<f32>();
        }
        let inv = 1.0 / sum;
        scale_mul(s, inv, std::ptr::null(), s, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_exp_within_a_few_ulp() {
        if !simd_available() {
            return;
        }
        let mut worst = 0f64;
        let mut x = -100.0f32;
        while x < 88.0 {
            let xs: [f32; 8] = std::array::from_fn(|i| x + i as f32 * 0.0013);
            let got = exp8(xs);
            for (g, &xi) in got.iter().zip(&xs) {
                let want = (xi as f64).exp();
                let rel = ((*g as f64) - want).abs() / want;
                if want > 1e-37 {
                    worst = worst.max(rel);
                }
            }
            x += 0.0117;
        }
        assert!(worst < 3.0 * f32::EPSILON as f64, "worst relative error {worst}");
        assert_eq!(exp8([-200.0; 8])[0], 0.0);
        assert!(exp8([100.0; 8])[0].is_infinite());
    }

    #[test]
    fn simd_helpers_match_scalar() {
        for n in [1usize, 7, 8, 9, 31, 64, 100, 1536] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 53 % 89) as f32 - 44.0) / 13.0).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let tol = 1e-5 * a.iter().zip(&b).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum::<f64>();
            assert!((dot(&a, &b) as f64 - want).abs() <= tol + 1e-6);
            let mut s = a.clone();
            softmax(&mut s);
            let max = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f64 = a.iter().map(|v| ((v - max) as f64).exp()).sum();
            for (v, x) in s.iter().zip(&a) {
                assert!((*v as f64 - ((x - max) as f64).exp() / z).abs() < 1e-6);
            }
            for gelu in [false, true] {
                let mut o = vec![0f32; n];
                let f: fn(f32) -> f32 = if gelu {
                    |x| 0.5 * x * (1.0 + (0.797_884_6f32 * (x + 0.044715 * x * x * x)).tanh())
                } else {
                    |x| x / (1.0 + (-x).exp())
                };
                unsafe { glu_ptr(gelu, a.as_ptr(), b.as_ptr(), o.as_mut_ptr(), n, f) };
                for i in 0..n {
                    let want = f(a[i]) * b[i];
                    assert!((o[i] - want).abs() <= 1e-6 * (1.0 + want.abs()), "gelu={gelu} {i}: {} vs {want}", o[i]);
                }
            }
        }
    }
}
