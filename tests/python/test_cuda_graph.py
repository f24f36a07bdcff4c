"""A whole training step of the packed op (input quantize, forward, backward) captured in a CUDA
graph and replayed on new data gives the eager results bit for bit: every kernel runs on torch's
current stream and every buffer comes from torch's allocator. The general layouts too, their
positions and norm weights read from memory at every replay."""
import pytest
import torch

import qkvfuse
from conftest import raw_bytes, requires_cuda
from layout_cases import MAIN_CASES, make, weights_of
from packed_problem import LAYOUT_CASES, LAYOUTS, Problem

CASES = {**{name: (layout, None) for name, layout in LAYOUTS.items() if name != "wide_v"},
         **LAYOUT_CASES}


def step(p, grads_out):
    x_f8, x_f8_t = qkvfuse.quantize_dual_layout(p.x.detach(), p.x_scale)
    args = list(p.arguments())
    args[15:17] = [x_f8, x_f8_t]
    outputs = qkvfuse.packed_fp8_qkv(*args, **p.options)
    inputs = (p.x, p.qk_weight, p.v_weight, p.qkv_scale, *p.norm_weights.values())
    grads = torch.autograd.grad(outputs, inputs, grads_out)
    return [t.detach() for t in outputs] + list(grads)


def capture(fn):
    """(graph, its outputs) after a warm-up on a side stream (cuBLASLt handles, allocator
    pools), as graph capture requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    return graph, captured


def change_inputs(tensors):
    """New values in place: fresh random data, positions shuffled."""
    with torch.no_grad():
        for t in tensors:
            if t.dtype in (torch.int32, torch.int64):
                t.copy_(t[torch.randperm(t.numel(), device=t.device)])
            else:
                t.copy_(torch.randn_like(t.float()).to(t.dtype))


@requires_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_graph_replay_matches_eager(name):
    layout, options = CASES[name]
    p = Problem(layout, "cuda", options)
    grads_out = [torch.randn_like(t) for t in qkvfuse.packed_fp8_qkv(*p.arguments(),
                                                                     **p.options)]
    graph, captured = capture(lambda: step(p, grads_out))
    change_inputs([p.x, *p.norm_weights.values()]
                  + [p.options[n] for n in ("positions",) if n in p.options])
    with torch.no_grad():
        p.qkv_scale.fill_(0.75)
    graph.replay()
    eager = step(p, grads_out)
    torch.cuda.synchronize()
    for replayed, expected in zip(captured, eager):
        assert torch.equal(raw_bytes(replayed), raw_bytes(expected)), name


@requires_cuda
@pytest.mark.parametrize("case", MAIN_CASES)
def test_rope_graph_replay_matches_eager(case):
    """qk_norm_rope's forward and backward (weight gradients and their workspace included)."""
    qk, kwargs = make(case, "cuda", requires_grad=True)
    weights = weights_of(kwargs)
    grads_out = [torch.randn_like(t) for t in qkvfuse.qk_norm_rope(qk, **kwargs)]

    def rope_step():
        q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
        grads = torch.autograd.grad((q, k), (qk, *weights.values()), grads_out)
        return [q.detach(), k.detach(), *grads]

    graph, captured = capture(rope_step)
    tables = [kwargs[n] for n in ("factor1", "factor2", "cos_sin", "positions")
              if kwargs.get(n) is not None]
    change_inputs([qk, *weights.values(), *tables])
    graph.replay()
    eager = rope_step()
    torch.cuda.synchronize()
    for replayed, expected in zip(captured, eager):
        assert torch.equal(raw_bytes(replayed), raw_bytes(expected)), case
