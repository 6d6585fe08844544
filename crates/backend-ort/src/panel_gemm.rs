//! The product of a batch by a weight stored as panels, read in place.
//!
//! A weight `W` (`K x N`) stored as panels (`[N / PANEL, K, PANEL]`, see `panels`) is laid
//! out the way ONNX Runtime's CPU MatMul (MLAS SGEMM) packs a right-hand side before it
//! multiplies: `K` rows of 16 contiguous columns per panel. Handed to MLAS, that layout
//! is still copied into a packing buffer at every run (a copy of the whole weight: on the
//! 100 MiB MLP, 2-8 rows ran 1.4-1.5x a prepacked session's time). This kernel multiplies
//! from the panels where they are (a mapping of the cached copy), the way MLAS's kernel
//! multiplies from a prepacked buffer: a block of rows of the batch against one or two
//! panels, the products accumulated in vector registers along `K`, so that the weight is
//! read once per run (per block of rows) and never written. At one to a few rows a run is
//! bound by reading the weight, as a prepacked one is; measured on the 100 MiB MLP (2
//! cores, AVX-512) against a prepacked ONNX Runtime session: 0.86-1.03x its time at 1-64
//! rows (`tests/panels_speed.rs`).
//!
//! Three kernels, chosen at run time: AVX-512 (12 rows by two panels), AVX2 with FMA (6
//! rows by one panel) and a portable one the compiler vectorises as it can. Each output
//! element is the same sum over `K`, in the same order, as a plain loop: results agree
//! with ONNX Runtime's MatMul to rounding, not bit for bit.

use std::ops::Range;

use crate::panels::PANEL;

/// Columns of `K` processed together when the batch has more rows than a kernel holds in
/// registers: a panel's slice of 512 rows (32 KiB) stays in the cache while every block of
/// rows is multiplied by it.
const K_BLOCK: usize = 512;

/// One product: `c` (`m x n`, row-major) = `a` (`m x k`, row-major) times the weight whose
/// panels are `w` (`[n / PANEL, k, PANEL]`).
pub(crate) struct Product<'a> {
    a: &'a [f32],
    w: &'a [f32],
    c: *mut f32,
    m: usize,
    k: usize,
    n: usize,
}

// SAFETY: `c` is written only through `run_panels`, whose callers give concurrent calls
// disjoint panels (disjoint columns of `c`).
unsafe impl Sync for Product<'_> {}

impl<'a> Product<'a> {
    /// The product, if the lengths agree with `m`, `k` and `n` (`n` a multiple of `PANEL`).
    pub(crate) fn new(
        a: &'a [f32],
        w: &'a [f32],
        c: &'a mut [f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Self, String> {
        if !n.is_multiple_of(PANEL) {
            return Err(format!("{n} columns are not whole panels of {PANEL}"));
        }
        let sizes = (m.checked_mul(k), k.checked_mul(n), m.checked_mul(n));
        if sizes != (Some(a.len()), Some(w.len()), Some(c.len())) {
            return Err(format!(
                "a {m} x {k} batch, a {k} x {n} weight and a {m} x {n} output do not have {}, {} and {} elements",
                a.len(),
                w.len(),
                c.len()
            ));
        }
        Ok(Product { a, w, c: c.as_mut_ptr(), m, k, n })
    }

    /// How many panels the weight has: `run_panels` shares them out.
    pub(crate) fn panels(&self) -> usize {
        self.n / PANEL
    }

    /// The columns of panels `panels`.
    ///
    /// # Safety
    /// Calls that run at the same time must be given disjoint ranges, within `panels()`.
    pub(crate) unsafe fn run_panels(&self, panels: Range<usize>) {
        // SAFETY: as this function's.
        unsafe { self.run_with(Kernel::best(), panels) }
    }

    /// # Safety
    /// As `run_panels`; the CPU has what `kernel` needs (`Kernel::available`).
    unsafe fn run_with(&self, kernel: Kernel, panels: Range<usize>) {
        assert!(panels.end <= self.panels());
        if self.m == 0 || panels.is_empty() {
            return;
        }
        if self.k == 0 {
            // An empty sum: the columns are zeros.
            for r in 0..self.m {
                // SAFETY: row r < m, the columns of `panels` < n: within `c`, this call's own.
                unsafe { self.c.add(r * self.n + panels.start * PANEL).write_bytes(0, panels.len() * PANEL) };
            }
            return;
        }
        match kernel {
            // SAFETY: the CPU has AVX-512F; the bounds hold (`new`, the assert above).
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { x86::run_avx512(self, panels) },
            // SAFETY: the CPU has AVX2 and FMA; the bounds hold.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { x86::run_avx2(self, panels) },
            // SAFETY: the bounds hold.
            Kernel::Portable => unsafe { run_portable(self, panels) },
        }
    }
}

/// The kernels, by the instructions they need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Kernel {
    /// The kernels this CPU can run, fastest first.
    fn available() -> Vec<Kernel> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                kernels.push(Kernel::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                kernels.push(Kernel::Avx2);
            }
        }
        kernels.push(Kernel::Portable);
        kernels
    }

    fn best() -> Kernel {
        static BEST: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| Kernel::available()[0])
    }
}

/// The blocks a kernel of `rows` rows by `width` panels goes through for `panels`: per
/// group of `width` panels (fewer at the end), per slice of `K`, per block of rows,
/// `micro(first row, panel, panels in the group (1..=width), K range, accumulate)`.
fn blocks(
    p: &Product<'_>,
    panels: Range<usize>,
    rows: usize,
    width: usize,
    mut micro: impl FnMut(usize, usize, usize, Range<usize>, bool),
) {
    let k_block = if p.m > rows { K_BLOCK } else { p.k };
    let mut panel = panels.start;
    while panel < panels.end {
        let group = width.min(panels.end - panel);
        let mut k0 = 0;
        while k0 < p.k {
            let k1 = (k0 + k_block).min(p.k);
            let mut r0 = 0;
            while r0 < p.m {
                micro(r0, panel, group, k0..k1, k0 > 0);
                r0 += rows.min(p.m - r0);
            }
            k0 = k1;
        }
        panel += group;
    }
}

/// One row by one panel at a time: the compiler vectorises the 16 columns.
///
/// # Safety
/// As `Product::run_panels`.
unsafe fn run_portable(p: &Product<'_>, panels: Range<usize>) {
    blocks(p, panels, 1, 1, |r, panel, _, ks, load| {
        let a = &p.a[r * p.k..(r + 1) * p.k];
        let w = &p.w[panel * p.k * PANEL..(panel + 1) * p.k * PANEL];
        // SAFETY: row r < m, the columns of `panel` < n: within `c`, this call's own.
        let c = unsafe { p.c.add(r * p.n + panel * PANEL) }.cast::<[f32; PANEL]>();
        // SAFETY: as above.
        let mut acc = if load { unsafe { c.read_unaligned() } } else { [0f32; PANEL] };
        for kk in ks {
            let b = &w[kk * PANEL..(kk + 1) * PANEL];
            for (s, b) in acc.iter_mut().zip(b) {
                *s += a[kk] * b;
            }
        }
        // SAFETY: as above.
        unsafe { c.write_unaligned(acc) };
    });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::{arch::x86_64::*, ops::Range};

    use super::{blocks, Product, PANEL};

    /// Rows of a block: 12 rows by two panels are 24 of the 32 vector registers.
    const AVX512_ROWS: usize = 12;
    /// 6 rows by one panel (two registers each) are 12 of 16.
    const AVX2_ROWS: usize = 6;

    /// Where a block reads and writes: `a` at its first row, the group's first panel
    /// (`w`), the next one (`w2`, the same when the group has one) and `c` at the block's
    /// first row and column.
    struct Block {
        a: *const f32,
        w: *const f32,
        w2: *const f32,
        c: *mut f32,
    }

    fn block(p: &Product<'_>, r0: usize, panel: usize, group: usize) -> Block {
        let w = p.w[panel * p.k * PANEL..].as_ptr();
        Block {
            a: p.a[r0 * p.k..].as_ptr(),
            w,
            w2: if group > 1 { p.w[(panel + 1) * p.k * PANEL..].as_ptr() } else { w },
            // SAFETY (of the offset): r0 < m, panel < n / PANEL.
            c: unsafe { p.c.add(r0 * p.n + panel * PANEL) },
        }
    }

    /// # Safety
    /// The CPU has AVX-512F; as `Product::run_panels`.
    pub(super) unsafe fn run_avx512(p: &Product<'_>, panels: Range<usize>) {
        blocks(p, panels, AVX512_ROWS, 2, |r0, panel, group, ks, load| {
            let b = block(p, r0, panel, group);
            let rows = AVX512_ROWS.min(p.m - r0);
            macro_rules! by_rows {
                ($($r:literal)*) => {
                    match (rows, group) {
                        $(
                            // SAFETY: the block lies within `a`, `w` and `c` (see `block`).
                            ($r, 2) => unsafe { avx512::<$r, true>(&b, p.k, p.n, ks, load) },
                            ($r, _) => unsafe { avx512::<$r, false>(&b, p.k, p.n, ks, load) },
                        )*
                        _ => unreachable!("a block has 1 to {AVX512_ROWS} rows"),
                    }
                };
            }
            by_rows!(1 2 3 4 5 6 7 8 9 10 11 12);
        });
    }

    /// `R` rows by one panel, or two (`TWO`), over `ks`; `load`: add to what `c` holds.
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512<const R: usize, const TWO: bool>(
        b: &Block,
        k: usize,
        n: usize,
        ks: Range<usize>,
        load: bool,
    ) {
        let mut lo = [_mm512_setzero_ps(); R];
        let mut hi = [_mm512_setzero_ps(); R];
        // SAFETY (all accesses): rows < R of the block, columns of its panels, `ks` < k.
        unsafe {
            if load {
                for r in 0..R {
                    lo[r] = _mm512_loadu_ps(b.c.add(r * n));
                    if TWO {
                        hi[r] = _mm512_loadu_ps(b.c.add(r * n + PANEL));
                    }
                }
            }
            for kk in ks {
                let w = _mm512_loadu_ps(b.w.add(kk * PANEL));
                let w2 = if TWO { _mm512_loadu_ps(b.w2.add(kk * PANEL)) } else { w };
                for r in 0..R {
                    let x = _mm512_set1_ps(*b.a.add(r * k + kk));
                    lo[r] = _mm512_fmadd_ps(x, w, lo[r]);
                    if TWO {
                        hi[r] = _mm512_fmadd_ps(x, w2, hi[r]);
                    }
                }
            }
            for r in 0..R {
                _mm512_storeu_ps(b.c.add(r * n), lo[r]);
                if TWO {
                    _mm512_storeu_ps(b.c.add(r * n + PANEL), hi[r]);
                }
            }
        }
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; as `Product::run_panels`.
    pub(super) unsafe fn run_avx2(p: &Product<'_>, panels: Range<usize>) {
        blocks(p, panels, AVX2_ROWS, 1, |r0, panel, group, ks, load| {
            let b = block(p, r0, panel, group);
            let rows = AVX2_ROWS.min(p.m - r0);
            macro_rules! by_rows {
                ($($r:literal)*) => {
                    match rows {
                        // SAFETY: the block lies within `a`, `w` and `c` (see `block`).
                        $( $r => unsafe { avx2::<$r>(&b, p.k, p.n, ks, load) }, )*
                        _ => unreachable!("a block has 1 to {AVX2_ROWS} rows"),
                    }
                };
            }
            by_rows!(1 2 3 4 5 6);
        });
    }

    /// `R` rows by one panel (two 8-wide registers a row) over `ks`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2<const R: usize>(b: &Block, k: usize, n: usize, ks: Range<usize>, load: bool) {
        let mut lo = [_mm256_setzero_ps(); R];
        let mut hi = [_mm256_setzero_ps(); R];
        // SAFETY (all accesses): rows < R of the block, columns of its panel, `ks` < k.
        unsafe {
            if load {
                for r in 0..R {
                    lo[r] = _mm256_loadu_ps(b.c.add(r * n));
                    hi[r] = _mm256_loadu_ps(b.c.add(r * n + 8));
                }
            }
            for kk in ks {
                let w0 = _mm256_loadu_ps(b.w.add(kk * PANEL));
                let w1 = _mm256_loadu_ps(b.w.add(kk * PANEL + 8));
                for r in 0..R {
                    let x = _mm256_set1_ps(*b.a.add(r * k + kk));
                    lo[r] = _mm256_fmadd_ps(x, w0, lo[r]);
                    hi[r] = _mm256_fmadd_ps(x, w1, hi[r]);
                }
            }
            for r in 0..R {
                _mm256_storeu_ps(b.c.add(r * n), lo[r]);
                _mm256_storeu_ps(b.c.add(r * n + 8), hi[r]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panels_of(w: &[f32], k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; k * n];
        for p in 0..n / PANEL {
            for r in 0..k {
                for j in 0..PANEL {
                    out[(p * k + r) * PANEL + j] = w[r * n + p * PANEL + j];
                }
            }
        }
        out
    }

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// Every row count a kernel's blocks split differently (1-13, 25), a `K` over one
    /// slice, an odd number of panels (a last group of one), against a plain loop in f64;
    /// the kernel this CPU picks, the portable one, and the panels shared out in parts.
    #[test]
    fn products_match_a_plain_loop() {
        for (rows, k, n) in
            [(1, 7, 16), (3, 1200, 48), (13, 600, 80), (25, 33, 32), (8, 513, 16), (0, 5, 16), (2, 0, 32)]
        {
            {
                let a = values(rows * k, 1);
                let w = values(k * n, 2);
                let wp = panels_of(&w, k, n);
                let want: Vec<f64> = (0..rows * n)
                    .map(|i| (0..k).map(|q| a[i / n * k + q] as f64 * w[q * n + i % n] as f64).sum())
                    .collect();
                let check = |c: &[f32], how: &str| {
                    for (i, (&got, &want)) in c.iter().zip(&want).enumerate() {
                        let tol = 1e-5 * (k as f64).sqrt().max(1.0);
                        assert!(
                            (got as f64 - want).abs() < tol,
                            "{how} m={rows} k={k} n={n} [{i}]: {got} vs {want}"
                        );
                    }
                };
                for kernel in Kernel::available() {
                    let mut c = vec![f32::NAN; rows * n];
                    let p = Product::new(&a, &wp, &mut c, rows, k, n).unwrap();
                    // SAFETY: one call; this CPU has the kernel.
                    unsafe { p.run_with(kernel, 0..p.panels()) };
                    check(&c, &format!("{kernel:?}"));
                }
                let mut c = vec![f32::NAN; rows * n];
                let product = Product::new(&a, &wp, &mut c, rows, k, n).unwrap();
                let panels = product.panels();
                std::thread::scope(|s| {
                    let product = &product;
                    for part in [0..panels / 2, panels / 2..panels] {
                        // SAFETY: the two parts are disjoint.
                        s.spawn(move || unsafe { product.run_panels(part) });
                    }
                });
                check(&c, "in two parts");
            }
        }
    }

    #[test]
    fn sizes_that_disagree_are_refused() {
        let (a, w, mut c) = (vec![0f32; 6], vec![0f32; 48], vec![0f32; 32]);
        assert!(Product::new(&a, &w, &mut c, 2, 3, 16).is_ok());
        let refused = |e: Result<Product<'_>, String>| e.err().unwrap_or_default();
        assert!(refused(Product::new(&a, &w, &mut c, 2, 3, 15)).contains("whole panels"));
        assert!(refused(Product::new(&a[..5], &w, &mut c, 2, 3, 16)).contains("elements"));
        assert!(refused(Product::new(&a, &w, &mut c[..16], 2, 3, 16)).contains("elements"));
    }
}
