//! Kernel sources, NVRTC compilation to CUBIN for the device's own architecture, and the on-disk
//! CUBIN cache.
//!
//! All `.cu` files are compiled as one program: `common.cuh` first, then each file behind a
//! `#line 1 "<file>"` directive so NVRTC's messages name the file and line. The CUBIN is cached at
//! `$TURBOSPARK_HOME/cuda-cache/` (default `~/.cache/turbospark/cuda-cache/`) under a hash of the
//! source, the options, the architecture and the NVRTC version; a hit skips NVRTC entirely.

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};

/// The kernel files, in program order: (file name, source).
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("elementwise.cu", include_str!("../kernels/elementwise.cu")),
    ("matmul.cu", include_str!("../kernels/matmul.cu")),
    ("attention.cu", include_str!("../kernels/attention.cu")),
    ("moe.cu", include_str!("../kernels/moe.cu")),
    ("fast.cu", include_str!("../kernels/fast.cu")),
    ("fused.cu", include_str!("../kernels/fused.cu")),
    ("mmq.cu", include_str!("../kernels/mmq.cu")),
    ("mmh.cu", include_str!("../kernels/mmh.cu")),
    ("mla_prefill.cu", include_str!("../kernels/mla_prefill.cu")),
];

/// Options every compilation uses besides the architecture. No fast-math: the kernels must match
/// the CPU reference (precise `expf`, `sincosf`, `tanhf`, IEEE division).
pub const OPTIONS: &[&str] = &["--std=c++17", "-default-device"];

/// The whole program text.
pub fn program_source() -> String {
    let mut s = String::new();
    for (name, src) in SOURCES {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(src);
        s.push('\n');
    }
    s
}

/// True when `libnvrtc` can be loaded (probing first: a missing library would panic in cudarc).
pub fn nvrtc_available() -> bool {
    unsafe { nvrtc_sys::is_culib_present() }
}

/// NVRTC's (major, minor) version. Call only when [`nvrtc_available`].
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    let (mut a, mut b) = (0, 0);
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut a, &mut b) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion failed: {r:?}"));
    }
    Ok((a, b))
}

/// Compile the whole program for `arch` (e.g. `sm_90`) to CUBIN with NVRTC. The error is NVRTC's
/// log (file:line messages).
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>, String> {
    compile_cubin_with(arch, &[]).map(|(cubin, _)| cubin)
}

/// As [`compile_cubin`] with extra NVRTC options (e.g. `--ptxas-options=-v`, which makes ptxas
/// report each kernel's registers, spills and shared memory); returns the CUBIN and NVRTC's log.
pub fn compile_cubin_with(arch: &str, extra: &[&str]) -> Result<(Vec<u8>, String), String> {
    if !nvrtc_available() {
        return Err("libnvrtc could not be loaded (needed to compile the CUDA kernels)".into());
    }
    let src = CString::new(program_source()).map_err(|_| "kernel source holds a NUL byte".to_string())?;
    let name = CString::new("turbospark.cu").expect("static name");
    let prog = nvrtc_result::create_program(&src, Some(&name)).map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
    let mut opts: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    opts.push(format!("--gpu-architecture={arch}"));
    opts.extend(extra.iter().map(|s| s.to_string()));
    let compiled = unsafe { nvrtc_result::compile_program(prog, &opts) };
    let log = unsafe { nvrtc_result::get_program_log(prog) }
        .map(|l| unsafe { CStr::from_ptr(l.as_ptr()) }.to_string_lossy().into_owned())
        .unwrap_or_default();
    let out = match compiled {
        Err(e) => Err(format!("NVRTC failed to compile the kernels for {arch} ({e:?}):\n{log}")),
        Ok(()) => {
            let mut size = 0usize;
            let r = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) };
            if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                Err(format!("nvrtcGetCUBINSize failed: {r:?} (is {arch} a real architecture?)"))
            } else {
                let mut buf = vec![0u8; size];
                let r = unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char) };
                if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                    Err(format!("nvrtcGetCUBIN failed: {r:?}"))
                } else {
                    Ok((buf, log))
                }
            }
        }
    };
    let _ = unsafe { nvrtc_result::destroy_program(prog) };
    out
}

/// 64-bit FNV-1a: a stable hash (std's hasher may change between Rust releases).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The cache folder: `$TURBOSPARK_HOME/cuda-cache`, else `$HOME/.cache/turbospark/cuda-cache`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(h) = std::env::var_os("TURBOSPARK_HOME").filter(|s| !s.is_empty()) {
        return Some(PathBuf::from(h).join("cuda-cache"));
    }
    std::env::var_os("HOME").filter(|s| !s.is_empty()).map(|h| PathBuf::from(h).join(".cache/turbospark/cuda-cache"))
}

/// Where the CUBIN of this program for `arch` compiled by NVRTC `ver` (with `extra` options) is
/// cached.
pub fn cache_path(arch: &str, ver: (i32, i32), extra: &[&str]) -> Option<PathBuf> {
    let src = program_source();
    let opts = OPTIONS.iter().chain(extra).copied().collect::<Vec<_>>().join(" ");
    let v = format!("{}.{}", ver.0, ver.1);
    let key = fnv1a(&[src.as_bytes(), opts.as_bytes(), arch.as_bytes(), v.as_bytes()]);
    cache_dir().map(|d| d.join(format!("kernels-{arch}-{key:016x}.cubin")))
}

/// The CUBIN for `arch` (compiled with `extra` options, e.g. `-DTS_TRACE`): from the cache when
/// present, else compiled and stored (atomically; a cache that cannot be written is not an
/// error). Returns (cubin, whether it came from the cache).
pub fn load_or_compile(arch: &str, extra: &[&str]) -> Result<(Vec<u8>, bool), String> {
    if !nvrtc_available() {
        return Err("libnvrtc.so could not be loaded: it is needed to compile (or look up the cached build of) the CUDA kernels".into());
    }
    let path = cache_path(arch, nvrtc_version()?, extra);
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok((bytes, true));
            }
        }
    }
    let (cubin, _) = compile_cubin_with(arch, extra)?;
    if let Some(p) = path {
        if let Some(dir) = p.parent() {
            if std::fs::create_dir_all(dir).is_ok() {
                let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &cubin).is_ok() {
                    let _ = std::fs::rename(&tmp, &p);
                }
            }
        }
    }
    Ok((cubin, false))
}
