"""apply_qkvfuse under FSDP2 (issue 31): two processes over gloo on the CPU (and over NCCL on two
GPUs, where a machine has them), a tiny Qwen3 with
fully_shard on each decoder layer and then on the whole model (and, once, on the whole model
only), trained for a few AdamW steps; each rank's micro-batch is half of the global batch.

The reference is one process running the same two micro-batches one after the other and
accumulating their gradients (each loss / 2): what two ranks compute, micro-batch for
micro-batch, with the same per-call FP8 scales (current scaling of x and of the gradient is per
call, so a reference that ran the global batch in one call would quantize with other scales and
differ by FP8 rounding, not float rounding). Asserted per configuration:
- the loss of every step (mean over ranks) and every gradient of the first step (gathered whole)
  equal to the reference within RTOL, and the parameters after the last step as well (gathered
  whole on each rank: identical across ranks, bit for bit);
- fp8=True: the FP8 weights follow the optimizer (a stale weight would show in the losses of the
  later steps; each call quantizes the weights it is given, which FSDP has gathered), never
  from a shard: the attention input called outside the forward, while the weights are shards,
  is refused with an error that names the DTensor weight.
- the bf16 path in float64 against the *unpatched* one-process model, first step: the patched
  model's own tolerance (2e-6, test_transformers_integration.py; HF's norm runs in float32).

RTOL = 1e-6. Measured: 0 (the same bits). Two ranks add each gradient element as a + b, one order
only, and FSDP's division by the world size (2) is exact, so the gradients are those of the
accumulation bit for bit; the bound leaves room for a backend or FSDP version that sums or
divides in another order (float32 rounding, about 6e-8 per addition, a few of them per element).
A cache of the FP8 weights kept across forwards (a stale FP8 weight) moved the second step's loss
by 2.4e-3; a bank of every layer's weights, as that cache built, mixed the running layer's
gathered weights with the other layers' DTensor shards and raised on the first forward.

On two GPUs (NCCL) the same runs use eager attention, torch's deterministic algorithms and the
FP8 GEMM's first heuristic choice (QKVFUSE_FP8_GEMM_AUTOTUNE=0: two processes could otherwise
time different algorithms for one shape), so the ranks and the reference run the same kernels;
the bound is CUDA_RTOL, still far below a stale weight's effect.
"""
import copy
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

transformers = pytest.importorskip(
    "transformers",
    reason="Hugging Face transformers is not installed (pip install .[transformers])")
if not dist.is_available():  # pragma: no cover - torch builds without torch.distributed
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

from torch.distributed.fsdp import fully_shard  # noqa: E402

from qkvfuse.integrations.transformers import apply_qkvfuse, attention_input  # noqa: E402

WORLD = 2
STEPS = 3
LAYERS = 2
RTOL = 1e-6
CUDA_RTOL = 1e-5
F64_RTOL = 2e-6
TIMEOUT_S = 600  # the whole spawn (process start, imports, every configuration)
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2

# name: (master weights' dtype, bf16 autocast, fp8, where fully_shard goes, reference, steps)
CONFIGS = {
    "bf16": (torch.float32, True, False, "layers", "patched", STEPS),
    "fp8": (torch.float32, True, True, "layers", "patched", STEPS),
    "fp8-root-only": (torch.float32, True, True, "root", "patched", STEPS),
    "float64-vs-unpatched": (torch.float64, False, False, "layers", "unpatched", 1),
}
CPU_ONLY = {"float64-vs-unpatched"}  # qkvfuse on CUDA needs bf16 activations


def make_model(dtype, device):
    """A 2-layer Qwen3 (GQA 4/2 heads of 32, width 64): T = 2 x 16 tokens per micro-batch, a
    multiple of 16, so fp8=True runs the FP8 op. Norm weights moved off 1 (a misplaced weight
    shows)."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        initializer_range=0.1, rms_norm_eps=1e-3, use_cache=False, pad_token_id=None,
        bos_token_id=None, eos_token_id=None)
    # Eager attention on CUDA: sdpa's backward kernels may add in a run-dependent order.
    attn = "sdpa" if device.type == "cpu" else "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model.to(device, dtype).train()


def micro_batches(device):
    """[step][micro-batch] input ids [2, 16], the same on every rank."""
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, 97, (2, 16), generator=g).to(device) for _ in range(WORLD)]
            for _ in range(STEPS)]


def loss_of(model, ids, autocast):
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=ids, labels=ids).loss


def whole(t):
    """A parameter or gradient as one plain tensor (FSDP: gathered; every rank calls)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double().cpu()


def train_sharded(rank, config, batches, device):
    dtype, autocast, fp8, wrap, _, steps = config
    model = make_model(dtype, device)
    apply_qkvfuse(model, fp8=fp8)
    if wrap == "layers":
        for layer in model.model.layers:
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(steps):
        loss = loss_of(model, batches[step][rank], autocast)
        loss.backward()
        if step == 0:
            grads = {n: whole(p.grad) for n, p in model.named_parameters()}
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / WORLD).item())
        optimizer.step()
        optimizer.zero_grad()
    out = dict(losses=losses, grads=grads,
               params={n: whole(p) for n, p in model.named_parameters()})
    if fp8:
        # Outside the forward the weights are shards: the FP8 path must refuse them by name.
        attn = model.model.layers[0].self_attn
        hidden = torch.randn(2, 16, 64, device=device)
        cos_sin = model.model.rotary_emb(hidden, torch.arange(16, device=device)[None])
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                attention_input(attn, hidden, cos_sin)
            out["shard_error"] = None
        except RuntimeError as error:
            out["shard_error"] = str(error)
    return out


def train_reference(config, batches, device):
    """One process, the two micro-batches of each step accumulated."""
    dtype, autocast, fp8, _, reference, steps = config
    model = make_model(dtype, device)
    if reference == "patched":
        apply_qkvfuse(model, fp8=fp8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(steps):
        total = 0.0
        for ids in batches[step]:
            loss = loss_of(model, ids, autocast)
            (loss / WORLD).backward()
            total = total + loss.detach()
        if step == 0:
            grads = {n: whole(p.grad) for n, p in model.named_parameters()}
        losses.append((total / WORLD).item())
        optimizer.step()
        optimizer.zero_grad()
    return dict(losses=losses, grads=grads,
                params={n: whole(p) for n, p in model.named_parameters()})


def worker(rank, device_type, store, out_dir):
    torch.set_num_threads(1)  # two processes on a 2-core CI machine
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True, warn_only=True)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    batches = micro_batches(device)
    results = {}
    for name, config in CONFIGS.items():
        if device_type == "cuda" and name in CPU_ONLY:
            continue
        results[name] = dict(sharded=train_sharded(rank, config, batches, device))
        if rank == 0:
            results[name]["reference"] = train_reference(config, batches, device)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs"))])
def results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"fsdp_{request.param}")
    if request.param == "cuda":
        # Every process started keeps NCCL's NVLink multicast off (it can take a shared host's
        # GPUs out of service); cuBLAS needs a fixed workspace for deterministic results.
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                          NVSHMEM_DISABLE_NVLS="1", CUBLAS_WORKSPACE_CONFIG=":4096:8",
                          QKVFUSE_FP8_GEMM_AUTOTUNE="0")
    context = mp.start_processes(worker, args=(request.param, str(out / "store"), str(out)),
                                 nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {WORLD} FSDP processes did not finish in {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return request.param, [torch.load(out / f"rank{r}.pt", weights_only=False)
                           for r in range(WORLD)]


def rel(out, ref):
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp_equals_one_process(results, name):
    device_type, results = results
    if device_type == "cuda" and name in CPU_ONLY:
        pytest.skip("qkvfuse on CUDA needs bf16 activations")
    _, _, fp8, _, reference, steps = CONFIGS[name]
    tol = F64_RTOL if reference == "unpatched" else RTOL if device_type == "cpu" else CUDA_RTOL
    ranks = [r[name]["sharded"] for r in results]
    ref = results[0][name]["reference"]
    for step, (mine, want) in enumerate(zip(ranks[0]["losses"], ref["losses"])):
        assert abs(mine - want) <= tol * abs(want), f"step {step + 1}: loss {mine} != {want}"
    assert ranks[0]["grads"].keys() == ref["grads"].keys()
    for n, want in ref["grads"].items():
        assert rel(ranks[0]["grads"][n], want) <= tol, (n, rel(ranks[0]["grads"][n], want))
    for n, want in ref["params"].items():
        # Every rank gathered the same parameters, and they are the reference's.
        for r in range(1, WORLD):
            assert torch.equal(ranks[r]["params"][n], ranks[0]["params"][n]), n
        assert rel(ranks[0]["params"][n], want) <= tol, (n, rel(ranks[0]["params"][n], want))
    if fp8:
        for r in ranks:
            error = r["shard_error"] or ""
            assert "q_proj.weight, k_proj.weight, v_proj.weight are DTensors" in error, error
