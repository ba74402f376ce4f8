//! Compiles src/shim.cpp against the libtorch that torch-sys linked (its include folder
//! sits beside the lib folder) and the CUDA headers of the pip wheel. Without CUDA headers
//! or libtorch_cuda the shim is built without CUDA and every call reports that.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/shim.cpp");
    println!("cargo:rerun-if-changed=src/ipc.cpp");
    println!("cargo:rerun-if-changed=src/adamw.cpp");
    println!("cargo:rerun-if-changed=src/rendezvous.cpp");
    println!("cargo:rerun-if-changed=src/process_group.cpp");
    println!("cargo:rerun-if-changed=src/torch_profiler.cpp");
    println!("cargo:rerun-if-changed=src/rope.cpp");
    println!("cargo:rerun-if-changed=src/rms_norm.cpp");
    println!("cargo:rerun-if-changed=src/swiglu.cpp");
    println!("cargo:rerun-if-changed=src/cudnn_attention.cpp");
    println!("cargo:rerun-if-changed=src/guarded.hpp");
    println!("cargo:rerun-if-changed=src/plain_kernel.hpp");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=MANTA_CUDA_INCLUDE");
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys reports its libtorch folder"),
    );
    let torch = lib
        .parent()
        .expect("libtorch lib folder has a parent")
        .to_path_buf();
    let include = torch.join("include");
    let cuda_include = std::env::var_os("MANTA_CUDA_INCLUDE")
        .map(PathBuf::from)
        .or_else(|| {
            // pip layout: site-packages/torch/lib -> site-packages/nvidia/cu*/include
            let nvidia = torch.parent()?.join("nvidia");
            std::fs::read_dir(&nvidia)
                .ok()?
                .flatten()
                .map(|e| e.path().join("include"))
                .find(|p| p.join("cuda_runtime_api.h").is_file())
                .or_else(|| Some(nvidia.join("cuda_runtime/include")))
                .filter(|p| p.join("cuda_runtime_api.h").is_file())
        })
        .or_else(|| {
            let p = PathBuf::from("/usr/local/cuda/include");
            p.join("cuda_runtime_api.h").is_file().then_some(p)
        });
    // cuda_runtime.h needs crt/ (the nvidia-cuda-nvcc wheel, requirements-dev.txt).
    let cuda_include = cuda_include.filter(|p| p.join("crt/host_config.h").is_file());
    let with_cuda = cuda_include.is_some() && lib.join("libtorch_cuda.so").is_file();
    if !with_cuda {
        println!(
            "cargo:warning=manta-cuda: no CUDA libtorch or CUDA headers (crt/host_config.h) \
             found; CUDA graphs are disabled in this build"
        );
    }
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("src/shim.cpp")
        .file("src/ipc.cpp")
        .file("src/adamw.cpp")
        .file("src/rendezvous.cpp")
        .file("src/process_group.cpp")
        .file("src/torch_profiler.cpp")
        .file("src/rope.cpp")
        .file("src/rms_norm.cpp")
        .file("src/swiglu.cpp")
        .file("src/cudnn_attention.cpp")
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .flag_if_supported("-Wno-interference-size")
        .include(&include)
        .include(include.join("torch/csrc/api/include"));
    if let (true, Some(cuda)) = (with_cuda, &cuda_include) {
        build.define("MANTA_WITH_CUDA", None).include(cuda);
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        // ProcessGroupNCCL.hpp needs nccl.h (the nvidia-nccl wheel) and, through
        // cuda_fp16.h, CCCL's nv/target (the nvidia-cuda-cccl wheel).
        let nccl = torch
            .parent()
            .map(|site| site.join("nvidia/nccl/include"))
            .filter(|p| p.join("nccl.h").is_file());
        let cccl = cuda.join("nv/target").is_file();
        match (nccl, cccl) {
            (Some(nccl), true) => {
                build.define("MANTA_WITH_NCCL", None).include(nccl);
            }
            (nccl, _) => println!(
                "cargo:warning=manta-cuda: no NCCL process group in this build: {}",
                if nccl.is_none() {
                    "nccl.h not found (site-packages/nvidia/nccl/include)"
                } else {
                    "CCCL's nv/target not found beside the CUDA headers (pip nvidia-cuda-cccl)"
                }
            ),
        }
        // Prefill attention through cuDNN (cudnn_attention.cpp) needs cudnn.h (the
        // nvidia-cudnn wheel torch brings) and the header-only cuDNN frontend (the
        // nvidia-cudnn-frontend wheel, which installs its headers in site-packages/include).
        let site = torch.parent().map(PathBuf::from);
        let cudnn = site
            .as_ref()
            .map(|s| s.join("nvidia/cudnn/include"))
            .filter(|p| p.join("cudnn.h").is_file());
        let frontend = site
            .as_ref()
            .map(|s| s.join("include"))
            .filter(|p| p.join("cudnn_frontend.h").is_file());
        match (cudnn, frontend) {
            (Some(cudnn), Some(frontend)) => {
                // System headers: the frontend's own warnings are not this crate's.
                build
                    .define("MANTA_WITH_CUDNN", None)
                    .flag(format!("-isystem{}", cudnn.display()))
                    .flag(format!("-isystem{}", frontend.display()));
            }
            (cudnn, _) => println!(
                "cargo:warning=manta-cuda: no cuDNN prefill attention in this build: {}",
                if cudnn.is_none() {
                    "cudnn.h not found (site-packages/nvidia/cudnn/include)"
                } else {
                    "cudnn_frontend.h not found (pip nvidia-cudnn-frontend)"
                }
            ),
        }
    }
    build.compile("manta_cuda_shim");
}
