//! CI check that needs no GPU: every kernel compiles with NVRTC for sm_90 (and for sm_75, without the sm_80 paths).
//!
//! Needs `libnvrtc.so.13` on the loader path (the PyPI wheel `nvidia-cuda-nvrtc==13.0.88` puts it
//! at `<site-packages>/nvidia/cu13/lib`); without it the test prints a loud SKIP and passes.

#[test]
fn all_kernels_compile_for_sm_90() {
    if !ts_cuda::kernels::nvrtc_available() {
        eprintln!("\n*** SKIP: libnvrtc could not be loaded; kernels were NOT compiled (install nvidia-cuda-nvrtc==13.0.88 and put its lib folder on LD_LIBRARY_PATH) ***\n");
        return;
    }
    let ver = ts_cuda::kernels::nvrtc_version().expect("nvrtc version");
    let t = std::time::Instant::now();
    match ts_cuda::kernels::compile_cubin("sm_90") {
        Ok(cubin) => eprintln!(
            "NVRTC {}.{}: all kernels compiled for sm_90, {} bytes of CUBIN in {:.1} s",
            ver.0,
            ver.1,
            cubin.len(),
            t.elapsed().as_secs_f64()
        ),
        Err(log) => panic!("{log}"),
    }
}

/// The build an H100 or H200 gets (`CudaBackend::new` picks sm_90a there): the same kernels plus
/// the wgmma ones (`mmh_*`, `mmh8_*`, whose bodies are empty in a plain sm_90 build).
#[test]
fn all_kernels_compile_for_sm_90a() {
    if !ts_cuda::kernels::nvrtc_available() {
        eprintln!("\n*** SKIP: libnvrtc could not be loaded; kernels were NOT compiled for sm_90a ***\n");
        return;
    }
    if let Err(log) = ts_cuda::kernels::compile_cubin("sm_90a") {
        panic!("{log}");
    }
}

/// Registers, spills and shared memory per kernel as ptxas reports them (sm_90):
/// `cargo test --release -p ts-cuda --test nvrtc_compile -- --ignored --nocapture`.
#[test]
#[ignore]
fn kernel_resources_sm_90() {
    if !ts_cuda::kernels::nvrtc_available() {
        eprintln!("SKIP: libnvrtc could not be loaded");
        return;
    }
    // TS_RES_DEFINES="A=1,B=2": measurement defines to price as well (-DA=1 -DB=2).
    let extra: Vec<String> =
        std::env::var("TS_RES_DEFINES").unwrap_or_default().split([',', ' ']).filter(|d| !d.is_empty()).map(|d| format!("-D{d}")).collect();
    let mut opts = vec!["--ptxas-options=-v"];
    opts.extend(extra.iter().map(String::as_str));
    match ts_cuda::kernels::compile_cubin_with("sm_90", &opts) {
        Ok((_, log)) => {
            for line in log.lines().filter(|l| l.contains("Compiling entry") || l.contains("Used") || l.contains("spill")) {
                eprintln!("{line}");
            }
        }
        Err(log) => panic!("{log}"),
    }
}

/// The measurement builds compile too: the trace (`TS_CUDA_TRACE=1`: `-DTS_TRACE`, common.cuh)
/// and `mla_split_tc_h`'s other ring depths (`TS_CUDA_MS_NB=3`, `4`: `-DMS_NB=n`).
#[test]
fn trace_build_compiles_for_sm_90() {
    if !ts_cuda::kernels::nvrtc_available() {
        eprintln!("\n*** SKIP: libnvrtc could not be loaded; the trace build was NOT compiled ***\n");
        return;
    }
    for opt in ["-DTS_TRACE", "-DMS_NB=2", "-DMS_NB=4"] {
        if let Err(log) = ts_cuda::kernels::compile_cubin_with("sm_90", &[opt]) {
            panic!("{opt}: {log}");
        }
    }
}

/// The kernels compile for a GPU without the sm_80 paths (sm_75, a T4: no cp.async, ldmatrix or
/// int8/f16 mma.sync; the backend then keeps the tensor-core kernels off): the helpers every
/// kernel uses must live outside the `__CUDA_ARCH__ >= 800` blocks.
#[test]
fn kernels_compile_for_sm_75() {
    if !ts_cuda::kernels::nvrtc_available() {
        eprintln!("\n*** SKIP: libnvrtc could not be loaded; the sm_75 build was NOT compiled ***\n");
        return;
    }
    if let Err(log) = ts_cuda::kernels::compile_cubin("sm_75") {
        panic!("sm_75: {log}");
    }
}

/// The measurement defines of the decode MoE (`TS_CUDA_DEFINES=TS_WNA=0`: plain weight loads, not
/// the default's loads that do not allocate in L1; `NM_RACY=1`: the q / kv_a product's norm
/// without its block counter; `GQ_DOWN16_MIN_BLOCKS=3`: the 16-bit down kernels' old setting)
/// and of the split MLA decode (the old settings: `MS_SLD=32`, unpadded score rows;
/// `MLA_SM_BRANCHLESS=0`, the softmax with branches; `MS_QK_U=2`, the score loop unrolled twice;
/// `MS_ST2=0` and `MP_ST2=0`, single-float partial and prompt output stores; and the measurement
/// define `MO_MU=4`, the merge's splits in flight; `L2PF_LAST=1`, the L2 prefetches with
/// evict_last) compile too.
#[test]
fn measurement_defines_compile_for_sm_90() {
    if !ts_cuda::kernels::nvrtc_available() {
        eprintln!("SKIP: libnvrtc could not be loaded");
        return;
    }
    if let Err(log) = ts_cuda::kernels::compile_cubin_with(
        "sm_90",
        &[
            "-DTS_WNA=0",
            "-DNM_RACY=1",
            "-DGQ_DOWN16_MIN_BLOCKS=3",
            "-DMS_SLD=32",
            "-DMLA_SM_BRANCHLESS=0",
            "-DMS_QK_U=2",
            "-DMS_ST2=0",
            "-DMP_ST2=0",
            "-DMO_MU=4",
            "-DMMQ_OFF_EARLY=0",
            "-DMMQ_ROWS_KO=7",
            "-DMOE_PIN_ROUTE=1",
            "-DMMQ_ROWS_NA=0",
            "-DMS_NB_B=1",
            "-DMS_KFIRST=0",
            "-DL2PF_LAST=1",
        ],
    ) {
        panic!("{log}");
    }
}
