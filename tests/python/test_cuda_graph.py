"""A whole training step of the packed op (input quantize, forward, backward) captured in a CUDA
graph and replayed on new data gives the eager results bit for bit: every kernel runs on torch's
current stream and every buffer comes from torch's allocator."""
import torch

import qkvfuse
from conftest import raw_bytes, requires_cuda
from packed_problem import LAYOUTS, Problem


def step(p, grads_out):
    x_f8, x_f8_t = qkvfuse.quantize_dual_layout(p.x.detach(), p.x_scale)
    args = list(p.arguments())
    args[15:17] = [x_f8, x_f8_t]
    outputs = qkvfuse.packed_fp8_qkv(*args)
    grads = torch.autograd.grad(outputs, (p.x, p.qk_weight, p.v_weight, p.qkv_scale), grads_out)
    return [t.detach() for t in outputs] + list(grads)


@requires_cuda
def test_graph_replay_matches_eager():
    for name in ("plain", "paired", "key_offset"):
        p = Problem(LAYOUTS[name], "cuda")
        grads_out = [torch.randn_like(t) for t in qkvfuse.packed_fp8_qkv(*p.arguments())]
        # Warm up on a side stream (cuBLASLt handles, allocator pools), as graph capture requires.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(p, grads_out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(p, grads_out)

        with torch.no_grad():
            p.x.copy_(torch.randn_like(p.x))
            p.qkv_scale.fill_(0.75)
        graph.replay()
        eager = step(p, grads_out)
        torch.cuda.synchronize()
        for replayed, expected in zip(captured, eager):
            assert torch.equal(raw_bytes(replayed), raw_bytes(expected)), name
