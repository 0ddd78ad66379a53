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
/// evict_last; `GU_SH_EARLY=0` and `RS_EARLY=0`, the gate/up's shared slots and the batch
/// router waiting before their weight loads; `DN16_EARLY=0`, the 16-bit down kernel waiting
/// before its first weights) compile too.
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
            "-DGU_SH_EARLY=0",
            "-DRS_EARLY=0",
            "-DDN16_EARLY=0",
        ],
    ) {
        panic!("{log}");
    }
}

/// `nvdisasm` for the SASS checks: `$NVDISASM`, else the PyPI wheel's (`nvidia-cuda-nvdisasm`,
/// `<site-packages>/nvidia/cu13/bin`, beside the NVRTC wheel's `lib` on the loader path).
fn nvdisasm() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("NVDISASM").map(std::path::PathBuf::from).filter(|p| p.is_file()) {
        return Some(p);
    }
    let dirs = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    dirs.split(':').filter(|d| !d.is_empty()).map(|d| std::path::Path::new(d).join("../bin/nvdisasm")).find(|p| p.is_file())
}

/// Kernels that load their weights before the PDL wait (the overlap programmatic dependent launch
/// buys) must still do so in the CUBIN the H100/H200 run (sm_90a): ptxas may schedule
/// `griddepcontrol.wait` (SASS `ACQBULK`) above loads of the same basic block, and did in the
/// decode MoE gate/up until the forty-sixth session (their loads now sit in a branch of their
/// own; `tools/gpu/sass_static.py --pdl` prints the same count for every kernel). Needs NVRTC
/// and nvdisasm (`.ci/run` installs both); skips loudly without them.
#[test]
fn weight_loads_stay_before_the_pdl_wait() {
    let Some(nvd) = nvdisasm().filter(|_| ts_cuda::kernels::nvrtc_available()) else {
        eprintln!("\n*** SKIP: NVRTC or nvdisasm missing; the early loads were NOT checked (pip install nvidia-cuda-nvdisasm) ***\n");
        return;
    };
    let cubin = ts_cuda::kernels::compile_cubin("sm_90a").unwrap_or_else(|log| panic!("{log}"));
    let path = std::env::temp_dir().join(format!("ts-pdl-{}.cubin", std::process::id()));
    std::fs::write(&path, &cubin).expect("write the CUBIN");
    let out = std::process::Command::new(&nvd).arg("-c").arg(&path).output().expect("run nvdisasm");
    let _ = std::fs::remove_file(&path);
    assert!(out.status.success(), "nvdisasm: {}", String::from_utf8_lossy(&out.stderr));
    let sass = String::from_utf8_lossy(&out.stdout);
    // Per function: the loads, copies and prefetches before its first ACQBULK (None: no wait).
    let mut counts: std::collections::HashMap<String, Option<usize>> = std::collections::HashMap::new();
    let (mut cur, mut before, mut waited) = (String::new(), 0usize, false);
    for line in sass.lines() {
        let l = line.trim();
        if let Some(name) = l.strip_prefix(".text.").and_then(|n| n.strip_suffix(':')) {
            cur = name.to_string();
            (before, waited) = (0, false);
            counts.insert(cur.clone(), None);
            continue;
        }
        let Some(ins) = l.split_once("*/").map(|(_, r)| r.trim()).filter(|r| r.ends_with(';')) else { continue };
        let ins = if ins.starts_with('@') { ins.split_once(' ').map_or("", |(_, r)| r) } else { ins };
        let op = ins.split(|c: char| c == '.' || c.is_whitespace() || c == ';').next().unwrap_or("");
        if waited || cur.is_empty() {
            continue;
        }
        match op {
            "ACQBULK" => {
                waited = true;
                counts.insert(cur.clone(), Some(before));
            }
            "LDG" | "LDGSTS" | "CCTL" | "UBLKPF" => before += 1,
            _ => {}
        }
    }
    let must = [
        "moe_gateup_sh_q8q",
        "moe_gateup_sh_q8t",
        // (Not moe_gateup_sh_q8d: its blocks without a shared unit wait first, having nothing
        // to load, and ptxas puts that wait first; its shared units run moe_gateup_q8q_unit's
        // early loads, as moe_gateup_sh_q8q's do, which `sass_static.py SASS_DUMP=all` shows.)
        "moe_gateup_sh_f16",
        "moe_gateup_sh_bf16",
        "moe_down_sh_q8",
        "mmq_q8_rows",
        "mmq_q8_rows_r2",
        "gemv_q8_multi_norm_1",
        "mla_split_tc_he",
        "mla_split_tc_hep",
        "mla_out_q8",
        "mla_out_q8p",
        "gemv_f32_split",
        "moe_down_sh_f16",
        "moe_down_sh_bf16",
    ];
    let bad: Vec<String> = must
        .iter()
        .filter_map(|k| match counts.get(*k) {
            Some(Some(n)) if *n > 0 => None,
            Some(Some(_)) => Some(format!("{k}: no load before its wait")),
            Some(None) => Some(format!("{k}: no griddepcontrol.wait")),
            None => Some(format!("{k}: not in the CUBIN")),
        })
        .collect();
    assert!(bad.is_empty(), "weights no longer loaded before the PDL wait:\n{}", bad.join("\n"));
    eprintln!("early loads before the PDL wait: {} kernels checked", must.len());
}
