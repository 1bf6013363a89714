"""Linear projections whose weights are laid out for the device that runs them.

Checkpoints store a projection as Hugging Face does, ``weight [out, in]`` and
``y = x @ weight.T``. On a CPU in fp32 that is the slow way round for the small
row counts of decode: MKL's sgemm with a transposed right operand runs 16-row
products at ~2/3 the speed of the same product on a ``[in, out]`` copy (this repo's
default model, one thread, weights in cache: 30 layers' projections at 16 rows 46.6 ->
27.3 ms; results bit-identical from 16 rows up). ``pack()`` re-lays the weight
once, after the model reached its device and dtype:

- ``"out_in"``: as loaded (GPU, bf16/fp16): ``F.linear``.
- ``"in_out"``: CPU fp32: a contiguous ``[in, out]`` copy, ``torch.mm`` / ``addmm``.
- ``"onednn"``: CPU fp32 wide projections (out >= 2 x in: the MLP's gate/up, the
  vocabulary head): oneDNN's blocked layout streams them from memory faster at the
  row counts of batched decode (30 gate/up matrices of 3072 x 576, 16 rows, one
  thread: 35.5 -> 25.8 ms; head 49152 x 576: 17.1 -> 12.3 ms), and each row's result
  is the same whatever the batch size. Narrower ones stream no faster that way.
  oneDNN caches a compiled primitive per input shape (up to 1,024 of them, each with
  its JIT code), so a server whose steps see every row count from 1 to the token budget
  grows by hundreds of MiB over an hour (benchmarks/soak.json). ``onednn_rows`` keeps the
  shapes few: a product of T rows runs as one of ``ONEDNN_ROW_CHUNK * k`` rows and one of
  the remaining ``< ONEDNN_ROW_CHUNK``, so a weight sees at most ``ONEDNN_ROW_CHUNK +
  T_max / ONEDNN_ROW_CHUNK`` shapes; since each row's result does not depend on the
  rows beside it, the split changes no bit.

- a quantised kernel (``use_kernel``, from ``kvserve.quant.transform``): int8 / int4
  weights multiplied by PyTorch's weight-only kernels; the float weight is dropped.

No copy is kept in the old layout (the ``[in, out]`` copy replaces ``weight``). A
vocabulary head tied to the embedding gets its own packed copy, since the embedding
lookup needs the rows of the ``[vocab, hidden]`` matrix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_MIN_WIDTH = 2        # out / in ratio from which the oneDNN layout is chosen
ONEDNN_ROW_CHUNK = 64       # row counts of oneDNN products: multiples of this, or fewer rows


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def bounded_rows(product, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``product(x, weight, bias)`` run as at most two products whose row counts come
    from a bounded set (see the module docstring)."""
    x = x.contiguous()
    rows = x.shape[0]
    bulk = rows - rows % ONEDNN_ROW_CHUNK
    if bulk == 0 or bulk == rows:
        return product(x, weight, bias)
    return torch.cat((product(x[:bulk], weight, bias), product(x[bulk:], weight, bias)))


class Projection(nn.Module):
    """``y = x @ W.T (+ bias)`` for ``x [T, in]``, with ``W`` given as ``[out, in]``.

    ``forward`` = ``reduce_(partial(x))``: a wrapper that adds to the product (LoRA) adds to
    ``partial``'s; here the product is whole and ``reduce_`` leaves it as it is (a row-parallel
    shard, ``partial_sums``, sums its partial products over the ranks there)."""

    partial_sums = False

    def __init__(self, out_features: int, in_features: int, bias: bool = False):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.layout = "out_in"
        self._onednn_weight: torch.Tensor | None = None
        self.kernel = None                  # a quantised kernel (use_kernel), not a parameter
        self.quantized_weight = None        # a loader's quantised source, until use_kernel

    def use_kernel(self, kernel) -> None:
        """Multiply by ``kernel`` (``kernel(x) -> x @ W.T``, with ``layout`` and ``nbytes``)
        from now on; the float weight and any quantised source are released."""
        self.kernel, self.layout = kernel, kernel.layout
        self.weight, self.quantized_weight, self._onednn_weight = None, None, None

    @property
    def packed_bytes(self) -> int:
        """Bytes of the oneDNN copy or the quantised kernel (not parameters), else 0."""
        if self.kernel is not None:
            return self.kernel.nbytes
        w = self._onednn_weight
        return 0 if w is None else w.numel() * w.element_size()

    def pack(self, onednn: bool | None = None) -> str:
        """Re-lay the weight for its device and dtype (see the module docstring); call
        once, after ``.to(device, dtype)``. ``onednn`` None: by width. Returns the layout."""
        w = self.weight
        if self.layout != "out_in" or w.device.type != "cpu" or w.dtype != torch.float32:
            return self.layout
        if onednn is None:
            onednn = self.out_features >= ONEDNN_MIN_WIDTH * self.in_features
        if onednn and torch.backends.mkldnn.is_available():
            try:
                self._onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
                probe = torch.linspace(-1, 1, self.in_features)[None]
                self.layout = "onednn"              # checked once: the op exists and computes the map
                # Projection's own product: a subclass's forward may add communication
                if torch.allclose(Projection.forward(self, probe), F.linear(probe, w, self.bias), rtol=1e-4, atol=1e-4):
                    self.weight = None
                    return self.layout
            except (RuntimeError, AttributeError, TypeError):   # a torch build without the ops
                pass
            self._onednn_weight, self.layout = None, "out_in"
        self.weight = nn.Parameter(w.detach().t().contiguous(), requires_grad=False)
        self.layout = "in_out"
        return self.layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self.kernel is not None:
            y = self.kernel(x)
            return y if self.bias is None else y.add_(self.bias)
        if self.layout == "in_out":
            return torch.mm(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)
        if self.layout == "onednn":
            return bounded_rows(_onednn_linear, x, self._onednn_weight, self.bias)
        if x.device.type == "cpu" and x.dtype != torch.float32:     # oneDNN's matmul on CPU
            return bounded_rows(F.linear, x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This process's product (the whole one: see the class docstring)."""
        return self.forward(x)

    def reduce_(self, y: torch.Tensor) -> torch.Tensor:
        """Products of the other processes added to ``y`` (none here)."""
        return y

    def accumulate_(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out += x @ W.T`` in place (a residual stream: no separate add pass)."""
        if self.layout == "onednn" or self.kernel is not None:
            return out.add_(self.forward(x))
        if self.bias is not None:
            out.add_(self.bias)
        weight = self.weight if self.layout == "in_out" else self.weight.t()
        if x.device.type != "cpu" or x.dtype == torch.float32:
            return out.addmm_(x, weight)
        bulk = x.shape[0] - x.shape[0] % ONEDNN_ROW_CHUNK      # oneDNN's matmul: bounded row counts
        for rows in (slice(0, bulk), slice(bulk, x.shape[0])):
            if rows.stop > rows.start:
                out[rows].addmm_(x[rows], weight)
        return out


def module_weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and of its projections' packed copies."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return params + sum(m.packed_bytes for m in module.modules() if isinstance(m, Projection))
