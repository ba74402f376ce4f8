"""Registers and spills of a runtime-compiled kernel, here, without a GPU.

The shim compiles its kernels with NVRTC at run time (source = defines + the .cu.inc files);
this does the same with the NVRTC of the venv's CUDA wheels, then asks ptxas for the
resource use, so a change's register count (and with it how many CTAs fit an SM) can be
checked before a device call.

  python3 bench/py/kernel_regs.py crates/cuda/src/bf16.cu.inc crates/cuda/src/gemv.cu.inc \
      -D K=4096 -D MR=1 -D R=2 -D SILU=0 -D NORM=1 -D KSPLIT=1 -D GEMV_WARPS=8
"""
import argparse
import ctypes
import glob
import os
import subprocess
import sys
import tempfile


def nvidia_root():
    for base in sys.path:
        root = os.path.join(base, "nvidia", "cu13")
        if os.path.isdir(root):
            return root
    sys.exit("error: no nvidia/cu13 package on sys.path (run with the project's .venv python)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", help=".cu.inc files, concatenated in this order")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE, prepended as #define")
    ap.add_argument("--arch", default="90", help="sm_ARCH (default 90)")
    args = ap.parse_args()
    root = nvidia_root()
    libs = sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so*")))
    if not libs:
        sys.exit(f"error: no libnvrtc.so under {root}/lib")
    # NVRTC opens its builtins library by name; load it first so the name resolves.
    for builtins in sorted(glob.glob(os.path.join(root, "lib", "libnvrtc-builtins.so*"))):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(libs[0])
    src = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in args.defines)
    for path in args.sources:
        with open(path) as f:
            src += f.read()
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) != 0:
        sys.exit("error: nvrtcCreateProgram failed")
    opts = (ctypes.c_char_p * 2)(f"--gpu-architecture=compute_{args.arch}".encode(), b"--std=c++17")
    rc = nvrtc.nvrtcCompileProgram(prog, 2, opts)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"error: NVRTC failed ({rc}) with {args.defines}:\n{log.value.decode()}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "wb") as f:
            f.write(ptx.value)
        out = subprocess.run([os.path.join(root, "bin", "ptxas"), "-v", f"--gpu-name=sm_{args.arch}", path,
                              "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    text = out.stdout + out.stderr
    print("\n".join(l for l in text.splitlines() if "Used" in l or "spill" in l or "error" in l.lower()))
    sys.exit(out.returncode)


if __name__ == "__main__":
    main()
