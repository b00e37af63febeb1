"""AdamW / Adam step on the host over flat fp32 shards (ZeRO-Offload's CPU step).

The contract is *bitwise* equality with ``torch.optim.AdamW(foreach=False)``
(equivalently ``torch.optim.Adam(foreach=False)`` with ``adam_w=False``),
which is torch's default on CPU and what plain data-parallel training uses,
so offloading the step never changes a single bit of training. ``foreach``
gives the same bits; ``fused=True`` does not (it computes the first moment
as ``m*b1 + g*(1-b1)`` instead of a ``lerp`` and takes ``sqrt`` in double),
so it is a separate, explicit choice here (``fused=True`` below), bitwise
equal to ``torch.optim.AdamW(fused=True)``.

How the exact step is made fast. The reference is seven separate ATen
kernels per tensor (mul, lerp, mul, addcmul, sqrt, div+add, addcdiv), each
streaming the whole shard through memory: ~20 passes over 4-byte arrays.
Here one C kernel does the same arithmetic, operation for operation, in one
pass (16 floats at a time with AVX-512, else 8 with AVX2), on
``torch.get_num_threads()`` threads:

- the same float32 roundings in the same order, with the fused
  multiply-adds exactly where ATen's compiled kernels have them (``lerp``
  is an ``fma``; ATen's ``addcmul`` is compiled with contraction into an
  ``fma``; ``add(alpha=)`` is an ``fma``);
- ``sqrt`` with the bits of the very function ATen calls for float
  ``sqrt``: MKL's ``vmsSqrt`` in high-accuracy mode (not correctly rounded:
  up to 0.75 ulp, so ``sqrtf`` differs). Calling it per tile halves the
  kernel's speed, so the kernel computes the sequence of MKL's SSE2 kernel
  inline (``mkl_ex_sqrt_ps``: rsqrt estimate, two Newton steps, no fma),
  and calls MKL only for special inputs (subnormal, inf, NaN). Where MKL
  runs another kernel (it picks one per CPU), the copy does not match and
  MKL is called for every tile; torch builds without MKL use ``sqrtf``.

Because "the same roundings as this torch build on this CPU" is an
empirical fact about binaries, the kernel is compiled on first use
(runtime/io/native.py: ``cc -O3 -march=native -ffp-contract=off``, cached under
``~/.cache/zdsl``) and then *checked*: the sqrt copy against MKL on a
million random floats, and the whole step against torch's single-tensor
Adam on awkward values (zeros, subnormals, magnitudes over 1e±10) for every
combination of its settings; the fastest variant that matches bit for bit
is used. If no compiler works or nothing matches, the step falls back to
the same ATen ops run tile by tile (exact by construction, about twice as
fast as the reference, far slower than the kernel) and says so in the log.
``exact_backend()`` tells which one runs.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch
from torch.optim import adam as torch_adam

from zdsl import env
from zdsl.runtime.dist.affinity import local_rank_and_world
from zdsl.runtime.io import native
from zdsl.runtime.io.host_access import host_access

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

log = structlog.get_logger("zdsl.runtime.offload.host_adam")

# MKL vector-math mode used by ATen for float sqrt: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
_VML_MODE = 0x00000002 | 0x00140000 | 0x00000100
_TILE_ELEMS = 1 << 18  # ATen fallback: elements per tile (1 MiB per fp32 array)
_MIN_PER_THREAD = 1 << 16  # below this, one thread: thread hand-off would cost more than it saves


class HostAdamError(ValueError):
    """Bad arguments to the host step (wrong dtype, device, sizes or layout)."""


def limit_host_threads(rank: int, world: int) -> int:
    """A CUDA rank's host threads (this step's kernel and ATen's CPU ops use torch's count): its
    share of the cores the process may use among this host's ranks, as a CPU rank gets from
    ``runtime/dist/affinity.set_cpu_threads`` (torch would give every rank of the host all the
    cores, and an offloaded step on 8 ranks would run 8 times as many threads as cores). An
    explicit OMP_NUM_THREADS wins. Returns torch's thread count."""
    if env.raw("OMP_NUM_THREADS") is None:
        _, local_world = local_rank_and_world(rank, world)
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, usable // max(1, local_world)))
    return torch.get_num_threads()


# ----------------------------------------------------------------------------
# the reference, tile by tile (exact by construction; the fallback)
# ----------------------------------------------------------------------------


def _scalars(step: int, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """Step size and sqrt of the second bias correction, computed exactly as torch does."""
    step_f = float(step)  # torch keeps the step in a float32 tensor and reads it back with .item()
    bias_correction1 = 1 - beta1**step_f
    bias_correction2 = 1 - beta2**step_f
    return lr / bias_correction1, bias_correction2**0.5


def _aten_tiled(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, adam_w) -> None:
    step_size, bc2_sqrt = _scalars(step, lr, beta1, beta2)
    n = param.numel()
    tile = min(n, _TILE_ELEMS)
    denom_buf = torch.empty(tile, dtype=torch.float32)
    grad_buf = torch.empty(tile, dtype=torch.float32) if (weight_decay != 0 and not adam_w) else None
    for a in range(0, n, tile):
        b = min(n, a + tile)
        p, g, m, v, d = param[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], denom_buf[: b - a]
        if weight_decay != 0 and adam_w:
            p.mul_(1 - lr * weight_decay)
        elif grad_buf is not None:  # weight decay folded into the gradient (Adam)
            g = torch.add(g, p, alpha=weight_decay, out=grad_buf[: b - a])
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        torch.sqrt(v, out=d)
        d.div_(bc2_sqrt).add_(eps)
        p.addcdiv_(m, d, value=-step_size)


# ----------------------------------------------------------------------------
# the compiled kernel
# ----------------------------------------------------------------------------


@dataclass
class _Kernel:
    fn: CFuncPtr
    sqrt_ptr: int | None  # MKL vmsSqrt, or None for IEEE sqrtf
    flags: int  # kernel flags that matched ATen: 4/8 (fma placement), 16/32 (inline sqrt, one pass)
    path: Path
    mt: CFuncPtr | None = None  # zdsl_adam_mt when built with OpenMP: threads in C


def _mkl_sqrt() -> int | None:
    """Address of MKL's vmsSqrt inside libtorch_cpu, which ATen uses for float sqrt."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = lib_dir / name
        if path.exists():
            try:
                return ctypes.cast(ctypes.CDLL(str(path)).vmsSqrt, ctypes.c_void_p).value
            except (OSError, AttributeError):
                return None
    return None


def _sample(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parameters, gradients and moments spanning many magnitudes, zeros and signs."""
    gen = torch.Generator().manual_seed(seed)
    scale = lambda: torch.exp(torch.randn(n, generator=gen) * 4)  # noqa: E731
    p = torch.randn(n, generator=gen) * scale()
    g = torch.randn(n, generator=gen) * scale()
    m = torch.randn(n, generator=gen) * scale() * 1e-2
    v = torch.rand(n, generator=gen) * scale() * 1e-3
    g[:64] = 0.0
    v[64:128] = 0.0
    p[128:192] = 0.0
    if n > 5010:  # subnormal second moments in the second tile: the sqrt's special-value path
        g[5000:5010] = 0.0
        v[5000:5010] = 1e-41
    return p, g, m, v


_CHECK_CASES = [  # (lr, beta1, beta2, eps, weight_decay, adam_w): every branch of the kernel
    (1e-3, 0.9, 0.999, 1e-8, 0.01, True),
    (3e-4, 0.9, 0.95, 1e-6, 0.1, False),
    (1e-2, 0.3, 0.99, 1e-8, 0.0, True),
    (5e-3, 0.8, 0.9, 1e-5, 0.0, False),
]


def _matches(kernel: _Kernel) -> bool:
    n = 3 * 4096 + 77  # several tiles and a ragged tail
    for case_index, (lr, b1, b2, eps, wd, adam_w) in enumerate(_CHECK_CASES):
        ref = _sample(n, case_index)
        p, g, m, v = ref
        ours = p.clone(), g.clone(), m.clone(), v.clone()
        for step in (1, 2, 7):
            _reference_step(*ref, step, lr, b1, b2, eps, wd, adam_w)
            _kernel_step(kernel, *ours, step, lr, b1, b2, eps, wd, adam_w, threads=1)
        if not all(torch.equal(a, b) for a, b in zip(ref, ours)):
            return False
    return True


def _reference_step(p, g, m, v, step, lr, b1, b2, eps, wd, adam_w) -> None:
    """torch.optim's single-tensor Adam/AdamW, called as torch.optim calls it; where this
    torch's private function has another signature, the same ATen ops run by
    ``_aten_tiled`` (tested against torch.optim in tests/runtime/test_host_adam.py)."""
    single_tensor_adam = getattr(torch_adam, "_single_tensor_adam", None)  # private: another torch may lack it
    if single_tensor_adam is not None:
        kwargs = dict(amsgrad=False, has_complex=False, beta1=b1, beta2=b2, lr=lr, weight_decay=wd, eps=eps,
                      maximize=False, capturable=False, differentiable=False, decoupled_weight_decay=adam_w)
        try:
            single_tensor_adam([p], [g], [m], [v], [], [torch.tensor(float(step - 1))], None, None, **kwargs)
            return
        except TypeError:  # another signature
            pass
    _aten_tiled(p, g, m, v, step, lr, b1, b2, eps, wd, adam_w)


def _replica_matches_mkl(lib: ctypes.CDLL, mkl: int) -> bool:
    """Whether the inline copy of MKL's sqrt gives MKL's bits on this CPU (MKL picks its
    code path by CPU, so the copy is right only where MKL runs the kernel it copies)."""
    replica = lib.zdsl_mkl_ex_sqrt
    replica.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    replica.restype = ctypes.c_int
    vsqrt = ctypes.cast(mkl, ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64))
    gen = torch.Generator().manual_seed(1234)
    # every exponent and mantissa pattern of the positive normal floats, at random, plus a ragged tail
    bits = torch.randint(0x00800000, 0x7F7FF000, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)[: (1 << 20) - 3]
    ours, theirs = torch.empty_like(x), torch.empty_like(x)
    if replica(x.numel(), x.data_ptr(), ours.data_ptr()) != 0:
        return False
    vsqrt(x.numel(), x.data_ptr(), theirs.data_ptr(), _VML_MODE)
    return torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def _load_kernel() -> _Kernel | None:
    # With OpenMP where the compiler has it (threads in C, no Python hand-off), else without.
    source = native.csrc("host_adam.c")
    lib = native.build("host_adam_omp", source, ("-fopenmp",)) or native.build("host_adam", source)
    if lib is None:
        log.warning("host_adam.no_kernel", fallback="aten_tiled")
        return None
    fn = lib.zdsl_adam
    path = Path(lib._name)
    F = ctypes.c_float
    args: list[type[ctypes._SimpleCData]] = \
        [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [F] * 8 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    fn.argtypes = args
    fn.restype = None
    mt = None
    if lib.zdsl_has_openmp():
        mt = lib.zdsl_adam_mt
        mt.argtypes = [*args, ctypes.c_int]
        mt.restype = None
    mkl = _mkl_sqrt()
    sqrt_modes: list[tuple[str, int | None, int]] = []  # (name, vsqrt pointer, extra flags), fastest first
    if mkl and _replica_matches_mkl(lib, mkl):
        sqrt_modes.append(("mkl-replica-1pass", mkl, 16 | 32))
        sqrt_modes.append(("mkl-replica", mkl, 16))
    if mkl:
        sqrt_modes.append(("mkl", mkl, 0))
    sqrt_modes.append(("ieee", None, 0))
    for sqrt_name, sqrt_ptr, sqrt_flag in sqrt_modes:
        for flags in (4 | 8, 8, 4, 0):
            kernel = _Kernel(fn, sqrt_ptr, flags | sqrt_flag, path, mt)
            if _matches(kernel):
                log.debug("host_adam.kernel", path=str(path), sqrt=sqrt_name, flags=kernel.flags)
                return kernel
    log.warning("host_adam.kernel_mismatch", path=str(path), fallback="aten_tiled",
                reason="no rounding variant of the kernel is bitwise equal to this torch build's AdamW")
    return None


_kernel_lock = threading.Lock()
_kernel_state: dict[str, _Kernel | None] = {}


def _kernel() -> _Kernel | None:
    with _kernel_lock:
        if "kernel" not in _kernel_state:
            try:
                _kernel_state["kernel"] = _load_kernel()
            except Exception as e:  # noqa: BLE001 - the fallback is exact; a broken kernel must not stop training
                log.warning("host_adam.kernel_failed", error=f"{type(e).__name__}: {e}", fallback="aten_tiled")
                _kernel_state["kernel"] = None
        return _kernel_state["kernel"]


_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pool_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="zdsl-host-adam")
        return _pools[threads]


def _kernel_step(kernel: _Kernel, p, g, m, v, step, lr, b1, b2, eps, wd, adam_w, *, threads: int) -> None:
    step_size, bc2_sqrt = _scalars(step, lr, b1, b2)
    flags = kernel.flags | (1 if adam_w else 0) | (2 if abs(1 - b1) >= 0.5 else 0)
    # Scalars as ATen sees them: Python doubles rounded once to float32.
    scalars = (1 - lr * wd, wd, 1 - b1, b2, 1 - b2, bc2_sqrt, eps, -step_size)
    n = p.numel()
    ptrs = [t.data_ptr() for t in (p, g, m, v)]

    def run(a: int, b: int) -> None:
        kernel.fn(*(x + 4 * a for x in ptrs), b - a, *scalars, flags, kernel.sqrt_ptr, _VML_MODE)

    threads = max(1, min(threads, n // _MIN_PER_THREAD))
    if threads == 1:
        run(0, n)
        return
    if kernel.mt is not None:
        kernel.mt(*ptrs, n, *scalars, flags, kernel.sqrt_ptr, _VML_MODE, threads)
        return
    per = ((n + threads - 1) // threads + 127) // 128 * 128  # whole rounds of the kernel's loop per thread
    # The calling thread takes the first range itself: one fewer thread wake-up per step.
    futures = [_pool(threads - 1).submit(run, a, min(n, a + per)) for a in range(per, n, per)]
    try:
        run(0, min(n, per))
    finally:
        for f in futures:
            f.result()


# ----------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------


def exact_backend() -> str:
    """Which exact implementation runs here: ``"kernel"`` or ``"aten_tiled"``."""
    return "kernel" if _kernel() is not None else "aten_tiled"


def _check(param, grad, exp_avg, exp_avg_sq) -> None:
    n = param.numel()
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise HostAdamError(f"host_adamw_: {name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
        if not t.is_contiguous():
            raise HostAdamError(f"host_adamw_: {name} must be contiguous")
        if t.numel() != n:
            raise HostAdamError(f"host_adamw_: {name} has {t.numel()} elements, param has {n}")


@torch.no_grad()
def host_adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w: bool = True,
    *,
    fused: bool = False,
    threads: int | None = None,
) -> None:
    """One Adam step, in place on ``param``, ``exp_avg`` and ``exp_avg_sq``.

    ``step`` is the 1-based number of this step (torch's ``state["step"]``
    after its increment). ``adam_w=True``: decoupled weight decay (AdamW);
    False: L2 penalty added to the gradient (Adam). ``grad`` is not changed.

    ``fused=False`` (default): bitwise equal to ``torch.optim.AdamW`` /
    ``Adam`` with ``foreach=False`` (and ``foreach=True``).
    ``fused=True``: ``torch._fused_adamw_`` / ``_fused_adam_``, bitwise equal
    to ``torch.optim.AdamW(fused=True)``, *not* to the above (a few ulps apart).
    ``threads``: worker threads for the exact kernel (default
    ``torch.get_num_threads()``).
    """
    _check(param, grad, exp_avg, exp_avg_sq)
    host_access(reads=(grad,), writes=(param, exp_avg, exp_avg_sq))   # the native kernel is no aten op
    if param.numel() == 0:
        return
    if fused:
        fused_op = torch._fused_adamw_ if adam_w else torch._fused_adam_
        step_t = torch.tensor(float(step - 1))
        step_t += 1  # torch.optim increments the float32 step tensor before the fused call
        fused_op([param], [grad], [exp_avg], [exp_avg_sq], [], [step_t], lr=lr, beta1=beta1, beta2=beta2,
                 weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    kernel = _kernel()
    if kernel is None:
        _aten_tiled(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, adam_w)
    else:
        _kernel_step(kernel, param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, adam_w,
                     threads=threads or torch.get_num_threads())
