"""Reading a captured CUDA graph: kernel names, library helpers, launches per layer."""

import ctypes

import pytest
import torch

from kimi_decode.bench import (KernelNodeParams, graph_kernel_names, graph_node_counts, is_library_helper,
                               short_kernel_name, time_graph)


def test_kernel_node_params_layout_matches_cuda_h():
    # CUDA_KERNEL_NODE_PARAMS_v2: func, 7 x unsigned (28 bytes, padded to 40), kernelParams, extra, kern, ctx
    assert ctypes.sizeof(KernelNodeParams) == 72
    assert KernelNodeParams.kernelParams.offset == 40
    assert KernelNodeParams.kern.offset == 56 and KernelNodeParams.ctx.offset == 64


@pytest.mark.parametrize("name, short", [
    ("_Z19splitKreduce_kernelILi32ELi16EiffffLb1ELb0ELb0EEv18cublasSplitKParamsIT1_EPKT2_", "splitKreduce_kernel"),
    ("_ZN7cutlass7Kernel2I55cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8EEvNT_6ParamsE",
     "Kernel2"),
    ("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_",
     "vectorized_elementwise_kernel"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)",
     "vectorized_elementwise_kernel"),
    ("kda_decode_kernel", "kda_decode_kernel"),
    ("_ZL12local_kernelPf", "local_kernel"),  # internal linkage
    ("_ZNK3foo6kernelEv", "kernel"),  # const member
])
def test_short_kernel_name(name, short):
    assert short_kernel_name(name) == short


def test_only_cublas_split_k_reduce_is_a_helper():
    assert is_library_helper("_Z19splitKreduce_kernelILi32ELi16EiffffLb1ELb0ELb0EEv18cublasSplitKParams")
    for name in ("_ZN7cutlass7Kernel2I55cutlass_80_wmma_tensorop_bf16_s161616gemm", "moe_down_kernel",
                 "mla_decode_combine", "_ZN2at6native29vectorized_elementwise_kernelILi4E"):
        assert not is_library_helper(name)


@pytest.mark.gpu
def test_graph_kernel_names_on_a_captured_graph():
    x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(7168, 512, device="cuda", dtype=torch.bfloat16)  # skinny: cuBLAS tends to split K
    out = torch.empty(1, 512, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.mm(x, w, out=out)
        out.mul_(2.0)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        step()
    names = graph_kernel_names(g)
    assert len(names) == graph_node_counts(g)["kernel"]
    assert "?" not in names and all(names)
    helpers = sum(map(is_library_helper, names))
    assert len(names) - helpers == 2  # one GEMM (with or without its split-K reduce) and one multiply
    t = time_graph([step, step], replays=5, warmup=1)
    assert t.launches_per_layer == 2 and t.kernels_per_layer == len(names) and t.copy_nodes_per_layer == 0
    assert len(t.kernel_names) == len(names) and t.kernel_names[-1] == "vectorized_elementwise_kernel"


@pytest.mark.gpu
def test_a_contiguous_copy_is_a_memcpy_node_and_counts_as_a_launch():
    """torch's copy_ between contiguous device tensors is captured as a memcpy node, not a kernel (the stock
    KDA layer's copy into core_attn_out at TP16); the launch count includes it, as the inventory does."""
    a = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)

    def step():
        b.copy_(a)
        b.mul_(2.0)

    t = time_graph([step, step, step], replays=5, warmup=1)
    assert t.copy_nodes_per_layer == 1 and t.kernels_per_layer == 1 and t.launches_per_layer == 2


@pytest.mark.gpu
def test_warmup_fills_its_time_and_the_first_replays_are_reported():
    """time_graph warms up for at least `warmup_ms` of replays (more than `warmup` when a replay is short), none
    beyond `warmup` when warmup_ms is 0, and reports the median of the first timed replays beside the median."""
    from kimi_decode.bench import FIRST_REPLAYS
    a = torch.randn(1 << 16, device="cuda")

    def step():
        a.mul_(1.0)

    t = time_graph([step], replays=2 * FIRST_REPLAYS, warmup=2, warmup_ms=5.0)
    assert t.warmup_replays > 2  # a replay of one small kernel takes microseconds: 5 ms needs many
    assert t.us_first > 0 and t.us_p10 <= t.us_median <= t.us_p90
    assert time_graph([step], replays=3, warmup=2, warmup_ms=0).warmup_replays == 2
