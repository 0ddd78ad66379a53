#!/usr/bin/env python3
"""Static SASS of the CUDA kernels without a GPU (docs/GPU.md): compiles kernels/*.cu with NVRTC
for sm_90 as the backend does (same options, plus -D defines), disassembles the CUBIN with nvdisasm
and prints, for each kernel named, registers and spills (ptxas) and the opcode histogram of its
hot loop (from the barrier before its first IMMA/HMMA to the branch after the last), or of the
whole function when it has no MMA.

Needs libnvrtc.so.13 (pip install nvidia-cuda-nvrtc==13.0.88; its lib folder on LD_LIBRARY_PATH)
and nvdisasm (pip download --no-deps nvidia-cuda-nvdisasm; unzip; nvidia/cu13/bin/nvdisasm, or
set NVDISASM).

Usage: tools/gpu/sass_static.py [-D NAME=VAL ...] KERNEL [KERNEL ...]   (SASS_DUMP=1: print the loop too,
       SASS_DUMP=all: the whole function, numbered, with where its PDL wait falls;
       SASS_ARCH=sm_90a: the build H100/H200 get, with the wgmma kernels)
e.g.   tools/gpu/sass_static.py mmq_q8_64 mmq_q8_rows
       tools/gpu/sass_static.py -D MMQ_ROWS_PAD=0 mmq_q8_rows
       tools/gpu/sass_static.py --pdl [KERNEL ...]   (every kernel without names)

--pdl: for each kernel, where its first griddepcontrol.wait (SASS ACQBULK) falls and how many
global loads, copies and prefetches (LDG, LDGSTS, CCTL, bulk prefetches) come before it. A kernel
meant to load its weights before the PDL wait must show them there: ptxas may schedule the wait
above loads of the same basic block (it did in moe_gateup_sh_q8q's shared slots; a branch of
their own keeps them first, common.cuh's ldw16_pre).
"""
import collections, ctypes, glob, os, re, subprocess, sys, tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..')
K = os.path.join(ROOT, 'crates', 'cuda', 'kernels')
# Program order of crates/cuda/src/kernels.rs (SOURCES).
FILES = ['common.cuh', 'elementwise.cu', 'matmul.cu', 'attention.cu', 'moe.cu', 'fast.cu', 'fused.cu', 'mmq.cu', 'mmh.cu',
         'mla_prefill.cu']


def compile_cubin(defines):
    lib = ctypes.CDLL('libnvrtc.so.13')
    src = ''.join('#line 1 "%s"\n' % f + open(os.path.join(K, f)).read() + '\n' for f in FILES)
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b'turbospark.cu', 0, None, None):
        sys.exit('nvrtcCreateProgram failed')
    opts = [b'--std=c++17', b'-default-device', b'--gpu-architecture=' + os.environ.get('SASS_ARCH', 'sm_90').encode(), b'--ptxas-options=-v']
    opts += [b'-D' + d.encode() for d in defines]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    log = log.value.decode(errors='replace')
    if rc:
        sys.exit(log)
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cub = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cub)
    return cub.raw, log


def resources(log):
    res, k = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            k = m.group(1)
        m = re.search(r'(\d+) bytes spill stores', line)
        if m and k:
            res.setdefault(k, {})['spill'] = int(m.group(1))
        m = re.search(r'Used (\d+) registers', line)
        if m and k:
            res.setdefault(k, {})['regs'] = int(m.group(1))
    return res


def opcode(ins):
    t = ins.split()
    o = t[1] if t[0].startswith('@') else t[0]
    return o.split('.')[0]


def functions(sass):
    """(name, instructions) of every function in nvdisasm's listing."""
    starts = [(i, l.strip()[len('.text.'):-1]) for i, l in enumerate(sass) if l.startswith('.text.')]
    for j, (st, fn) in enumerate(starts):
        end = starts[j + 1][0] if j + 1 < len(starts) else len(sass)
        yield fn, [m.group(1).strip() for l in sass[st:end] if (m := re.match(r'\s*/\*[0-9a-f]+\*/\s+(.*?);', l))]


def pdl_report(sass, names):
    for fn, ins in functions(sass):
        if names and fn not in names:
            continue
        acq = next((i for i, s in enumerate(ins) if opcode(s) == 'ACQBULK'), None)
        if acq is None:
            print(f'{fn}: no griddepcontrol.wait')
            continue
        pre = sum(1 for s in ins[:acq] if opcode(s) in ('LDG', 'LDGSTS', 'CCTL', 'UBLKPF', 'UTMAPF'))
        print(f'{fn}: wait at instruction {acq} of {len(ins)}, {pre} loads / prefetches before it')


def main():
    args, defines = sys.argv[1:], []
    pdl = bool(args) and args[0] == '--pdl'
    if pdl:
        args = args[1:]
    while args and args[0] == '-D':
        defines.append(args[1])
        args = args[2:]
    if not args and not pdl:
        sys.exit(__doc__)
    nvd = os.environ.get('NVDISASM') or next(iter(glob.glob('/tmp/nvd/nvidia/cu13/bin/nvdisasm')), 'nvdisasm')
    cubin, log = compile_cubin(defines)
    res = resources(log)
    for line in log.splitlines():
        if 'warning' in line.lower() and any(f in line for f in args):
            print(line)
    with tempfile.NamedTemporaryFile(suffix='.cubin') as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvd, '-c', f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    if pdl:
        pdl_report(sass, set(args))
        return
    for fn in args:
        try:
            start = next(i for i, l in enumerate(sass) if l.strip() == f'.text.{fn}:')
        except StopIteration:
            print(f'{fn}: not in the CUBIN')
            continue
        end = next((i for i in range(start + 1, len(sass)) if sass[i].startswith('.text.')), len(sass))
        ins = [m.group(1).strip() for l in sass[start:end] if (m := re.match(r'\s*/\*[0-9a-f]+\*/\s+(.*?);', l))]
        mma = [i for i, s in enumerate(ins) if opcode(s) in ('IMMA', 'HMMA', 'HGMMA')]
        lo, hi, what = 0, len(ins) - 1, 'function'
        if mma:
            bars = [k for k in range(mma[0]) if 'BAR.SYNC' in ins[k]]
            lo = bars[-1] if bars else mma[0]
            hi = next((k for k in range(mma[-1], len(ins)) if opcode(ins[k]) == 'BRA'), mma[-1])
            what = 'loop'
        body = ins[lo:hi + 1]
        c = collections.Counter(opcode(s) for s in body)
        r = res.get(fn, {})
        print(f"{fn}: {r.get('regs', '?')} registers, {r.get('spill', '?')} B spilled; {len(ins)} instructions, "
              f"{what} {len(body)}: " + ', '.join(f'{k} {v}' for k, v in c.most_common(24)))
        if os.environ.get('SASS_DUMP') == 'all':
            # The whole function, numbered, with where its PDL wait falls: what runs before the
            # wait and what after it (the part on the chain of dependent launches).
            acq = next((i for i, s in enumerate(ins) if opcode(s) == 'ACQBULK'), None)
            print(f'{fn}: PDL wait at instruction {acq}; the hot {what} is {lo}..{hi}')
            print('\n'.join(f'{i} {s}' for i, s in enumerate(ins)))
        elif os.environ.get('SASS_DUMP'):
            print('\n'.join(body))


if __name__ == '__main__':
    main()
