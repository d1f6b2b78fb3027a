"""The stock-vLLM decode schedule of one Kimi K3 layer (`kimi_k3_layer.md` §9).

One launch per kernel that stock vLLM launches on an H200 at decode: cuBLAS
GEMMs where vLLM uses cuBLAS, one Triton kernel where vLLM has one fused kernel.
Every launch is labelled with the vLLM op it stands for. Triton kernels run on
CPU tensors under `TRITON_INTERPRET=1` (tests) and compiled on a GPU.
"""
