"""A chain of foreach ops, and lists of every geometry torch's fused route
asks about, for the split-by-element tests (test_dtr_write_path.py on CPU,
_dtr_gpu_worker.py's `foreach` scenario on CUDA)."""
from __future__ import annotations

import os
import sys

# Sessions entered inside whole_foreach_recipes() split no foreach op by
# element: each output's recipe is every input, as before the split existed.
# The benchmark that compares the two owns the switch.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from bench_live_optimizer import whole_recipes as whole_foreach_recipes  # noqa: E402,F401


def foreach_chain(torch, n, ctx, reduction=True, device="cpu", dtypes=None):
    """Foreach ops whose outputs autograd saves one by one (t * t per
    element) and whose inputs are session values: under chaos each unpack
    recomputes its element. Every list argument kind a split must cut:
    Tensor[] (made and written), Scalar[], a single tensor all elements
    read, keyword arguments, and (`reduction`) a per-tensor reduction, whose
    backward unpacks its whole list at once. `dtypes`: element i's dtype
    (default float32). Returns the gradients and the session (ctx's value)."""
    dtypes = dtypes or [torch.float32] * n
    torch.manual_seed(0)
    ps = [torch.randn(16, device=device, dtype=d, requires_grad=True) for d in dtypes]
    xs = [torch.randn(16, device=device, dtype=d) for d in dtypes]
    scale = torch.tensor(1.5, device=device)
    scalars = [0.5 + i for i in range(n)]
    with ctx() as s:
        y = torch._foreach_mul(ps, 2.0)
        z = torch._foreach_add(y, xs, alpha=0.5)              # Tensor[] x 2, a keyword
        z = torch._foreach_mul(z, scale)                      # a single tensor every element reads
        z = torch._foreach_add(z, scalars)                    # Scalar[]
        z = torch._foreach_lerp(z, y, [0.25] * n)             # Scalar[] after two Tensor[]
        torch._foreach_addcmul_(z, y, xs, value=0.1)          # written in place, element by element
        norms = torch._foreach_norm(z) if reduction else [1.0] * n  # a per-tensor reduction
        w = [t * t * m for t, m in zip(z, norms)]
        del y, z, norms
        loss = sum(t.float().sum() for t in w)
        del w
    loss.backward()
    return [p.grad for p in ps], s


def foreach_geometries(torch, device="cpu"):
    """Lists of four tensors (4 x 6 floats each) varied one way at a time in
    what torch's CUDA fast route asks of each element (ForeachUtils.h,
    check_fast_path_restrictions). Name -> (self list, other list, whether a
    call on them splits by element where the device has fused kernels: every
    element passes, or every one fails)."""
    torch.manual_seed(0)
    c = lambda: torch.randn(4, 6, device=device)  # noqa: E731
    strided = lambda: torch.randn(4, 12, device=device)[:, ::2]  # noqa: E731  (not dense)
    transposed = lambda: torch.randn(6, 4, device=device).t()  # noqa: E731  (dense, other strides)
    column = lambda: torch.randn(4, 1, device=device)  # noqa: E731
    return {
        "contiguous": ([c() for _ in range(4)], [c() for _ in range(4)], True),
        "one element not dense": ([c() for _ in range(4)], [c(), c(), strided(), c()], False),
        "every element not dense": ([c() for _ in range(4)], [strided() for _ in range(4)], True),
        "one element's strides differ between lists": ([c() for _ in range(4)], [c(), transposed(), c(), c()], False),
        "every list transposed alike": ([transposed() for _ in range(4)], [transposed() for _ in range(4)], True),
        # the strides of a dimension of size 1 are not compared
        "one element's size-1 dimension with other strides": (
            [column() for _ in range(4)],
            [column(), torch.randn(1, 4, device=device).t(), column(), column()], True),
        "dtypes mixed": ([c() for _ in range(4)], [c(), c().double(), c(), c()], False),
    }


def foreach_geometry_grads(torch, xs, ys, ctx):
    """The gradients of weights multiplied into _foreach_add(xs, ys)'s
    outputs, which autograd saves and the program drops: under chaos, each is
    brought back by running the op again (on its element alone, where the
    call split). Returns the gradients and the session (ctx's value)."""
    torch.manual_seed(1)
    ws = [torch.randn(x.shape, device=x.device, requires_grad=True) for x in xs]
    with ctx() as s:
        zs = torch._foreach_add(xs, ys)
        loss = sum((z * w).sin().sum() for z, w in zip(zs, ws))
        del zs
    loss.backward()
    return [w.grad for w in ws], s


def optimizer_steps(torch, make, ctx, device="cpu", steps=3):
    """`steps` training steps of 12 parameters (of 8 to 19 floats) with the
    optimizer `make(params)` gives, each inside `ctx()`: forward, backward,
    clip_grad_norm_ (foreach: a norm per tensor, then a scaling), the
    optimizer's step. Returns the parameters."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(8 + i, device=device)) for i in range(12)]
    opt = make(ps)
    for _ in range(steps):
        with ctx():
            loss = sum((p * p * p).sum() for p in ps)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in ps]
