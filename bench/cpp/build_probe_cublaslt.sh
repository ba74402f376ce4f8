#!/usr/bin/env bash
# Builds bench/cpp/probe_cublaslt against the CUDA headers and libraries of the venv's
# nvidia pip wheels (no CUDA toolkit needed). Output: bin/probe_cublaslt.
set -euo pipefail
cd "$(dirname "$0")/../.."
NV=$(ls -d .venv/lib/python3*/site-packages/nvidia/cu13 | head -1)
mkdir -p bin
g++ -O2 -std=c++17 -I"$NV/include" bench/cpp/probe_cublaslt.cpp -o bin/probe_cublaslt \
  -L"$NV/lib" -l:libcublasLt.so.13 -l:libcublas.so.13 -l:libcudart.so.13 -Wl,-rpath,'$ORIGIN'
echo "built bin/probe_cublaslt"
